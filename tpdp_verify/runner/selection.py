"""Which of a gate run's searches (property, world size) to make: ``-k`` and ``--shard``.

``-k EXPR`` keeps the searches the expression matches, as pytest's ``-k`` does (its own
expression language: words, ``and``, ``or``, ``not``, parentheses), a word matching as a
case-insensitive substring of the property's name or of ``worldN``, its world size
(``-k "trains and not plain and world4"``). ``--shard K/N`` runs the K-th of N parts of the run's searches (property, world size). The
parts are balanced by each search's measured cost (``costs.json``: seconds at the ci
profile on 2 cores against torch 2.13.0, scaled by the profile's examples), greedily, the
costliest first onto the least loaded part: the same split on every machine, whatever
ran before. A search's verdict depends on that search alone (its draw, and the baseline
entries of its property and world size), so the parts' verdicts put together are the whole
run's (tpdp_verify.runner.merge).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tpdp_verify.errors import UsageError

COSTS = Path(__file__).with_name("costs.json")
CI_EXAMPLES = 40  # the examples a search drew where its cost was measured


def parse(text: str) -> tuple[int, int]:
    """``K/N`` -> (K, N), 1 <= K <= N."""
    k, _, n = text.partition("/")  # "1/0", "0/2", "3/2", "x": each refused
    if not (k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise UsageError(f"--shard takes K/N, the K-th of N parts (1 <= K <= N, as 2/4), not {text!r}")
    return int(k), int(n)


@functools.cache
def _measured() -> dict[str, float]:
    try:
        return json.loads(COSTS.read_text())["seconds"]
    except (OSError, ValueError, KeyError):
        return {}


def cost(name: str, world_size: int, max_examples: int) -> float:
    """A search's expected seconds: measured at ci, scaled by the examples it draws; a
    search never measured (a suite of one's own) costs the median of those that were."""
    measured = _measured()
    seconds = measured.get(f"{name}[world_size={world_size}]")
    if seconds is None:
        known = sorted(measured.values()) or [1.0]
        seconds = known[len(known) // 2]
    return seconds * max_examples / CI_EXAMPLES


def split(searches: list[tuple[str, int]], n: int, max_examples: int) -> list[list[tuple[str, int]]]:
    """The searches in ``n`` parts of about equal cost, each part in the run's own order."""
    load = [0.0] * n
    part_of: dict[tuple[str, int], int] = {}
    for search in sorted(searches, key=lambda s: (-cost(*s, max_examples), s)):
        k = min(range(n), key=lambda i: (load[i], i))
        part_of[search] = k
        load[k] += cost(*search, max_examples)
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
           max_examples: int) -> list[tuple[str, int]]:
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
        plan = split(plan, n, max_examples)[k - 1]
    return plan


def measure(record: dict) -> dict:
    """costs.json's content from the --json record of a whole ci run (2 cores)."""
    if record.get("profile") != "ci" or record.get("selection"):
        raise UsageError("measure costs from a whole `gate --profile ci` run's --json record")
    seconds = {search_id(p["name"], p["world_size"]): p["seconds"] for p in record["properties"]}
    return {"measured": f"gate --profile ci, torch {record['torch']}, 2 cores", "seconds": seconds}


if __name__ == "__main__":  # python -m tpdp_verify.runner.selection GATE.json: write costs.json from a ci run
    import sys

    COSTS.write_text(json.dumps(measure(json.loads(Path(sys.argv[1]).read_text())), indent=1) + "\n")
