"""Which of a gate run's searches (property, world size) to make: ``-k`` and ``--shard``.

``-k EXPR`` keeps the searches the expression matches, as pytest's ``-k`` does (its own
expression language: words, ``and``, ``or``, ``not``, parentheses), a word matching as a
case-insensitive substring of the property's name or of ``worldN``, its world size
(``-k "trains and not plain and world4"``).

``--shard K/N`` runs the K-th of N parts of the run's searches (property, world size).
The parts are balanced by each search's measured cost (``costs.json``: seconds on 2 cores
against torch 2.13.0, measured per profile; a profile not measured takes ci's, scaled by
its examples), greedily, the costliest first onto the least loaded part: the same split
on every machine, whatever ran before. A search's verdict depends on that search alone
(its draw, and the baseline entries of its property and world size), so the parts'
verdicts put together are the whole run's (tpdp_verify.runner.merge).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tpdp_verify.errors import UsageError
from tpdp_verify.runner.profiles import Profile

COSTS = Path(__file__).with_name("costs.json")
CI_EXAMPLES = 40  # the examples a search drew where its cost was measured


def parse(text: str) -> tuple[int, int]:
    """``K/N`` -> (K, N), 1 <= K <= N."""
    k, _, n = text.partition("/")  # "1/0", "0/2", "3/2", "x": each refused
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise UsageError(f"--shard takes K/N, the K-th of N parts (1 <= K <= N, as 2/4), not {text!r}")
    return int(k), int(n)


@functools.cache
def _measured() -> dict[str, dict]:
    """profile name -> {"measured": how, "seconds": search id -> seconds}."""
    try:
        tables = json.loads(COSTS.read_text())
    except (OSError, ValueError):
        return {}
    return tables if isinstance(tables, dict) else {}


def cost(name: str, world_size: int, profile: Profile) -> float:
    """A search's expected seconds: as measured at ``profile``, else at ci scaled by the
    examples it draws; a search never measured (a suite of one's own, a world size ci does
    not reach) costs the median of the profile's, scaled likewise."""
    sid = search_id(name, world_size)
    own = _measured().get(profile.name, {}).get("seconds", {})
    if sid in own:
        return own[sid]
    ci = _measured().get("ci", {}).get("seconds", {})
    scale = profile.max_examples / CI_EXAMPLES
    if sid in ci:
        return ci[sid] * scale
    if own:
        return sorted(own.values())[len(own) // 2]
    known = sorted(ci.values()) or [1.0]
    return known[len(known) // 2] * scale


def split(searches: list[tuple[str, int]], n: int, profile: Profile) -> list[list[tuple[str, int]]]:
    """The searches in ``n`` parts of about equal cost, each part in the run's own order."""
    load = [0.0] * n
    part_of: dict[tuple[str, int], int] = {}
    for search in sorted(searches, key=lambda s: (-cost(*s, profile), s)):
        k = min(range(n), key=lambda i: (load[i], i))
        part_of[search] = k
        load[k] += cost(*search, profile)
    return [[s for s in searches if part_of[s] == k] for k in range(n)]


def search_id(name: str, world_size: int) -> str:
    return f"{name}[world_size={world_size}]"


def keyword(expression: str):
    """``-k EXPR`` as a predicate of a search (name, world size)."""
    from _pytest.mark.expression import Expression

    try:
        compiled = Expression.compile(expression)
    except Exception as exc:  # SyntaxError since pytest 8.4, its own ParseError before
        raise UsageError(f"-k {expression!r} does not parse ({exc}); write words joined by and, or, not") from None
    return lambda name, ws: compiled.evaluate(lambda word, **_: word.lower() in f"{name} world{ws}".lower())


def select(plan: list[tuple[str, int]], expression: str | None, shard: str | None,
           profile: Profile) -> list[tuple[str, int]]:
    """The searches of ``plan`` that ``-k`` keeps, then the ``--shard``'s part of them."""
    if expression:
        matches = keyword(expression)
        kept = [s for s in plan if matches(*s)]
        if not kept:
            raise UsageError(f"-k {expression!r} selects none of the {len(plan)} searches; they are "
                             + ", ".join(search_id(*s) for s in plan[:4]) + (", ..." if len(plan) > 4 else ""))
        plan = kept
    if shard:
        k, n = parse(shard)
        plan = split(plan, n, profile)[k - 1]
    return plan


def measure(record: dict) -> dict:
    """costs.json's table for the profile of a whole run's --json record (2 cores): the
    searches' seconds, each part's record merged first (tpdp_verify.runner.merge) where
    the run was split."""
    if record.get("selection") or not record.get("properties"):
        raise UsageError("measure costs from a whole `gate` run's --json record (merge a split run's parts first)")
    seconds = {search_id(p["name"], p["world_size"]): p["seconds"] for p in record["properties"]}
    return {"measured": f"gate --profile {record['profile']}, torch {record['torch']}, 2 cores", "seconds": seconds}


if __name__ == "__main__":  # python -m tpdp_verify.runner.selection GATE.json: its profile's costs into costs.json
    import sys

    record = json.loads(Path(sys.argv[1]).read_text())
    COSTS.write_text(json.dumps({**_measured(), record["profile"]: measure(record)}, indent=1) + "\n")
