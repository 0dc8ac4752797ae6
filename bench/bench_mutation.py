"""Benchmark: the mutation score of the conformance suite.

Run as ``.venv/bin/python bench/bench_mutation.py [--only NAME ...] [--list]``. Every
mutant in tests/mutants.py (MUTANTS, MODULE_MUTANTS, TRAINING_MUTANTS), and every mutant
in tests/fsdp_mutants.py when that file exists, is an implementation under test with one
fault (``--impl mutants.Name``). For each one the ``ci`` profile's properties
(properties.ALL, then the FSDP-extension properties when properties/fsdp_extension.py
exists) run in the gate's order -- world size 2, then 4 -- with shrinking disabled, and
the mutant's run stops at the first property that fails: the mutant is killed, and the
table says by which property, at which world size, with which kind of divergence (or
exception), after how many examples of that property and how many seconds from the
mutant's start. A mutant that every property passes is a survivor: a fault the suite
cannot see, printed loudly.

A property counts as a kill only if the reference passes it: the first time a mutant
fails a property, the reference runs it too (once a world size; its time is not the
mutant's). The entry_points_* properties find torch's entry points departing whatever the
transform, so the reference fails them too; such a failure is listed, not counted.

A hang or a dead rank (PoolError) is never a kill: it is an infrastructure failure,
recorded separately, and the mutant's run goes on with the next property. A mutant with
no kill and an infrastructure failure has no verdict. Neither is an error of the harness
(an implementation that does not load, a hypothesis health check): those are listed too.

One RankPool per world size serves the whole run (a hang respawns its ranks; the table
counts respawns). Exit 0 when every mutant is killed, 1 when one survives, 3 when one has
no verdict and none survives, 2 on a usage error (an unknown --only name).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis.errors import FlakyFailure, HypothesisException
from hypothesis.reporting import with_reporter

from tpdp_verify.errors import (
    EXIT_DIVERGENCE,
    EXIT_INFRA,
    EXIT_OK,
    EXIT_USAGE,
    PoolError,
    RankFailed,
    UsageError,
)
from tpdp_verify.impls import select as impl_mod
from tpdp_verify.impls.transform import Transform
from tpdp_verify.judging.divergence import Divergence
from tpdp_verify.properties import ALL
from tpdp_verify.ranks.pool import RankPool
from tpdp_verify.runner import profiles
from tpdp_verify.runner.property import Property, Stats

TESTS = Path(__file__).resolve().parent.parent / "tests"
TRANSFORM, FSDP = "transform", "FSDP extension"
# Ranks are spawned: they get the parent's sys.path, so they import the mutants too.
sys.path.insert(0, str(TESTS))


# ---------------------------------------------------------------------------
# What runs: the mutants and the properties.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Mutant:
    name: str  # the class's name
    impl: str  # the implementation name the ranks load: "mutants.Name"
    group: str  # the list it comes from
    doc: str
    documented: tuple[str, ...]  # kinds its own tests expect (caught_by, training_caught_by)
    family: str = TRANSFORM  # what it implements (the transform or FSDP1's TP extension)


def _documented(cls) -> tuple[str, ...]:
    caught = getattr(cls, "caught_by", None)
    return tuple(sorted({*([caught] if caught else []), *getattr(cls, "training_caught_by", ())}))


def _family(cls) -> str | None:
    if issubclass(cls, Transform):
        return TRANSFORM
    extension = _fsdp_extension_base()
    return FSDP if extension is not None and issubclass(cls, extension) else None


def _fsdp_extension_base():
    try:
        return importlib.import_module("tpdp_verify.impls.fsdp_extension").FSDPExtension
    except (ModuleNotFoundError, AttributeError):
        return None


def _mutant(module, cls, group: str) -> Mutant:
    doc = re.split(r"(?<=[^.])\.(\s|$)", " ".join((cls.__doc__ or "").split()))[0]
    if not doc:  # what it overrides says where its one fault is
        doc = "overrides " + ", ".join(n for n in vars(cls) if not n.startswith("_")
                                       and callable(getattr(cls, n)))
    return Mutant(cls.__name__, f"{module.__name__}.{cls.__name__}", group, doc, _documented(cls),
                  _family(cls) or TRANSFORM)


def _defined_transforms(module) -> list[type]:
    """Implementations (Transform or FSDPExtension subclasses) defined in ``module``, in
    source order."""
    classes = [c for c in vars(module).values()
               if isinstance(c, type) and c.__module__ == module.__name__ and _family(c)]
    return sorted(classes, key=lambda c: inspect.getsourcelines(c)[1])


def _from_module(module_name: str) -> list[Mutant]:
    module = importlib.import_module(module_name)
    found: dict[str, Mutant] = {}
    lists = [n for n in vars(module) if n.endswith("MUTANTS") and isinstance(getattr(module, n), (list, tuple))]
    for group in lists:
        for cls in getattr(module, group):
            if cls.__name__ not in found:
                found[cls.__name__] = _mutant(module, cls, group if module_name == "mutants"
                                              else f"{module_name}.{group}")
    # a mutant somebody wrote but left out of every list still counts
    for cls in _defined_transforms(module):
        if cls.__name__ not in found and not cls.__name__.startswith(("_", "Reference")) \
                and not cls.__name__.endswith("Reference"):
            found[cls.__name__] = _mutant(module, cls, "(in no list)")
    return list(found.values())


def all_mutants() -> list[Mutant]:
    found = _from_module("mutants")
    if (TESTS / "fsdp_mutants.py").exists():
        taken = {m.name for m in found}
        found += [m for m in _from_module("fsdp_mutants") if m.name not in taken]
    return found


def all_properties() -> tuple[Property, ...]:
    """properties.ALL (the gate's suite, the FSDP extension's properties included), then any
    property of properties/fsdp_extension.py that ALL lacks. Every mutant runs against all of
    them: select.load and select.load_fsdp give a mutant of one family the reference of the other."""
    try:
        extension = importlib.import_module("tpdp_verify.properties.fsdp_extension")
    except ModuleNotFoundError as exc:
        if exc.name != "tpdp_verify.properties.fsdp_extension":
            raise
        return ALL
    extra = getattr(extension, "ALL", None)
    if extra is None:
        extra = [p for p in vars(extension).values() if isinstance(p, Property)]
    return ALL + tuple(p for p in extra if p not in ALL)


def load_check(mutant: Mutant) -> None:
    """Raise UsageError unless the ranks can load the mutant as the properties do."""
    impl_mod.load(mutant.impl)
    if hasattr(impl_mod, "load_fsdp"):
        impl_mod.load_fsdp(mutant.impl)


# ---------------------------------------------------------------------------
# Running one mutant.
# ---------------------------------------------------------------------------


@dataclass
class Result:
    mutant: Mutant
    status: str = "survived"  # "killed" | "survived" | "no verdict" | "error"
    killer: str = ""  # the property that killed it
    world_size: int = 0
    kinds: list[str] = field(default_factory=list)  # what failed, as the property reported it
    exception: str = ""  # the exception type the property raised
    examples: int = 0  # examples the killing property ran (explicit ones included)
    seconds: float = 0.0  # from the mutant's start to the kill (or to the end of its run)
    properties_run: int = 0
    infra: list[str] = field(default_factory=list)  # "property (world n): what happened"
    errors: list[str] = field(default_factory=list)  # harness errors: not a verdict either
    unattributed: list[str] = field(default_factory=list)  # failures the reference shares
    respawns: int = 0

    @property
    def documented(self) -> str:
        """Whether the kill is one the mutant's own tests name (caught_by)."""
        if self.status != "killed" or not self.mutant.documented:
            return "-"
        return "yes" if any(d in k for d in self.mutant.documented for k in self.kinds) else "no"



def kinds_of(exc: BaseException) -> tuple[list[str], str]:
    """The kinds of failure in what a property raised, and the exception's type name."""
    found = exc.exceptions if isinstance(exc, BaseExceptionGroup) else (exc,)
    kinds = []
    for e in found:
        if isinstance(e, Divergence):
            kind = e.kind
        elif isinstance(e, RankFailed) and e.tracebacks:  # what the ranks raised, not the wrapper
            last = e.tracebacks[min(e.tracebacks)].strip().splitlines()[-1]
            kind = f"raised on {len(e.tracebacks)} rank(s): {last[:90]}"
        else:
            lines = str(e).strip().splitlines()
            kind = f"{type(e).__name__}: {lines[0][:70] if lines else ''}"
        if kind not in kinds:
            kinds.append(kind)
    # a Divergence's type is named after its kind: say the type only when it adds something
    return kinds, "" if all(isinstance(e, Divergence) for e in found) else type(exc).__name__


def _is_harness_error(exc: BaseException) -> bool:
    """Hypothesis refusing to run (health check, unsatisfiable) or a bad impl: no verdict."""
    if isinstance(exc, UsageError):
        return True
    return isinstance(exc, HypothesisException) and not isinstance(exc, FlakyFailure)


def _first_line(text: str) -> str:
    lines = str(text).strip().splitlines()
    return lines[0] if lines else ""


def reference_verdict(prop: Property, pool: RankPool, profile: profiles.Profile,
                      controls: dict, log) -> str:
    """Whether the reference passes ``prop`` on this pool's world size (run once, then
    cached): "pass", "fails" or "hangs". Some properties fail whatever the transform
    (entry_points_*: the entry points' own departures in torch), so failing them says
    nothing about a mutant."""
    key = (prop.name, pool.world_size)
    if key not in controls:
        start = time.monotonic()
        try:
            with with_reporter(lambda _: None):
                prop.run(pool, "reference", profile, Stats())
            controls[key] = "pass"
        except PoolError:
            controls[key] = "hangs or dies"
        except Exception:
            controls[key] = "fails"
        log(f"    control: the reference on {prop.name} (world {pool.world_size}): {controls[key]}, "
            f"{time.monotonic() - start:.1f} s")
    return controls[key]


def run_mutant(mutant: Mutant, pools: dict[int, RankPool], props: tuple[Property, ...],
               profile: profiles.Profile, log, controls: dict) -> Result:
    result = Result(mutant)
    if not props:
        result.status, result.errors = "error", ["no property to run it against"]
        return result
    spawns = {ws: pool.spawns for ws, pool in pools.items()}
    start = time.monotonic()
    try:
        load_check(mutant)  # a mutant that does not load is the harness's problem
    except UsageError as exc:
        result.status, result.errors = "error", [str(exc)]
        return result
    for ws in profile.world_sizes:
        for prop in props:
            if ws < prop.min_world_size:
                continue
            stats, reported = Stats(), []
            prop_start = time.monotonic()
            result.properties_run += 1
            try:
                with with_reporter(reported.append):
                    prop.run(pools[ws], mutant.impl, profile, stats)
            except PoolError as exc:  # a hang or a dead rank: never a kill
                result.infra.append(f"{prop.name} (world {ws}): {type(exc).__name__}: {_first_line(exc)}")
                log(f"    {prop.name} (world {ws}): INFRASTRUCTURE FAILURE after "
                    f"{time.monotonic() - prop_start:.1f} s: {_first_line(exc)}")
                continue
            except Exception as exc:
                if _is_harness_error(exc):
                    result.errors.append(f"{prop.name} (world {ws}): {type(exc).__name__}: {_first_line(exc)}")
                    log(f"    {prop.name} (world {ws}): HARNESS ERROR {type(exc).__name__}: {_first_line(exc)}")
                    continue
                examples = stats.examples
                control_start = time.monotonic()
                control = reference_verdict(prop, pools[ws], profile, controls, log)
                start += time.monotonic() - control_start  # the control's time is not the mutant's
                if control != "pass":  # only a property the reference passes can kill a mutant
                    result.unattributed.append(f"{prop.name} (world {ws}): the reference {control} too")
                    log(f"    {prop.name} (world {ws}): fails, but the reference {control} too: not a kill")
                    continue
                result.status, result.killer, result.world_size = "killed", prop.name, ws
                result.kinds, result.exception = kinds_of(exc)
                result.examples = examples
                break
            log(f"    {prop.name} (world {ws}): passes, {stats.examples} examples, "
                f"{time.monotonic() - prop_start:.1f} s")
        if result.status == "killed":
            break
    result.seconds = time.monotonic() - start
    result.respawns = sum(pool.spawns - spawns[ws] for ws, pool in pools.items())
    if result.status != "killed" and (result.infra or result.errors):
        result.status = "no verdict"
    return result


# ---------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------


def table(results: list[Result]) -> str:
    head = (f"{'mutant':<24}{'status':<12}{'killed by':<36}{'world':>6}{'examples':>9}"
            f"{'seconds':>9}  {'as documented':<14}kind (exception)")
    lines = [head, "-" * len(head)]
    for r in results:
        kind = "; ".join(r.kinds)
        if r.exception and not r.exception.startswith(kind.split(":")[0]):
            kind += f" ({r.exception})"
        status = r.status.upper() if r.status != "killed" else "killed"
        lines.append(f"{r.mutant.name:<24}{status:<12}{r.killer or '-':<36}"
                     f"{r.world_size or '-':>6}{r.examples or '-':>9}{r.seconds:>9.1f}  "
                     f"{r.documented:<14}{kind}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--profile", default="ci", help="run profile (default ci)")
    parser.add_argument("--properties", nargs="+", metavar="PROPERTY",
                        help="run only these properties (default: all of them, in the gate's order)")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="seconds a call may take before its ranks are declared hung")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line per property that passes")
    args = parser.parse_args()

    mutants = all_mutants()
    if args.list:
        for m in mutants:
            print(f"{m.name:<24}{m.family:<16}{m.group:<22}{m.impl:<40}{m.doc}")
        return EXIT_OK
    if args.only:
        names = {m.name: m for m in mutants}
        unknown = [n for n in args.only if n not in names]
        if unknown:
            print(f"bench_mutation: unknown mutant {', '.join(unknown)}; --list shows the "
                  f"{len(names)} there are", file=sys.stderr)
            return EXIT_USAGE
        mutants = [names[n] for n in dict.fromkeys(args.only)]
    try:
        profile = dataclasses.replace(profiles.get(args.profile), shrink=False)
    except UsageError as exc:
        print(f"bench_mutation: {exc}", file=sys.stderr)
        return EXIT_USAGE
    props = all_properties()
    if args.properties:
        known = [p.name for p in props]
        unknown = [n for n in args.properties if n not in known]
        if unknown:
            print(f"bench_mutation: unknown property {', '.join(unknown)}; choose from "
                  f"{', '.join(known)}", file=sys.stderr)
            return EXIT_USAGE
        props = tuple(p for p in props if p.name in args.properties)

    print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}; profile {profile.name} "
          f"({profile.max_examples} examples, world sizes {profile.world_sizes}), shrinking off")
    families = ", ".join(f"{sum(m.family == f for m in mutants)} {f}" for f in dict.fromkeys(m.family for m in mutants))
    print(f"{len(mutants)} mutants ({families}) x {len(props)} properties: {', '.join(p.name for p in props)}\n",
          flush=True)

    log = (lambda line: print(line, flush=True)) if args.verbose else (lambda line: None)
    results, controls = [], {}
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        pools = {}
        for ws in profile.world_sizes:
            up = time.monotonic()
            pools[ws] = stack.enter_context(RankPool(ws, "gloo", timeout=args.timeout))
            print(f"world size {ws}: ranks up in {time.monotonic() - up:.1f} s", flush=True)
        for i, mutant in enumerate(mutants, 1):
            print(f"[{i:>2}/{len(mutants)}] {mutant.name} ({mutant.impl})", flush=True)
            r = run_mutant(mutant, pools, props, profile, log, controls)
            if r.status == "killed":
                print(f"    killed by {r.killer} (world {r.world_size}) after {r.examples} "
                      f"examples, {r.seconds:.1f} s: {'; '.join(r.kinds)}", flush=True)
            else:
                print(f"    {r.status.upper()} after {r.properties_run} properties, {r.seconds:.1f} s",
                      flush=True)
            for line in r.infra:
                print(f"    infrastructure failure, not a kill: {line}", flush=True)
            if r.respawns:
                print(f"    the ranks were respawned {r.respawns} time(s) during this mutant", flush=True)
            for line in r.errors:
                print(f"    harness error, not a kill: {line}", flush=True)
            for line in r.unattributed:
                print(f"    failed, not a kill: {line}", flush=True)
            results.append(r)
    total = time.monotonic() - start

    killed = [r for r in results if r.status == "killed"]
    survivors = [r for r in results if r.status == "survived"]
    undecided = [r for r in results if r.status in ("no verdict", "error")]
    print()
    print(table(results))
    print()
    print(f"mutation score: {len(killed)}/{len(results)} killed"
          + (f" ({len(killed) / len(results):.0%})" if results else "")
          + f"; {len(survivors)} survived; {len(undecided)} without a verdict; "
          f"total {total:.0f} s ({total / 60:.1f} min)")
    kill_times = sorted(r.seconds for r in killed)
    if kill_times:
        print(f"seconds to a kill: median {kill_times[len(kill_times) // 2]:.1f}, "
              f"max {kill_times[-1]:.1f}")
    infra = [(r.mutant.name, line) for r in results for line in r.infra]
    if infra:
        print(f"\ninfrastructure failures (hangs, dead ranks), none counted as a kill: {len(infra)}")
        for name, line in infra:
            print(f"  {name}: {line}")
    if survivors:
        bar = "!" * 78
        print(f"\n{bar}\nSURVIVORS: {len(survivors)} mutant(s) that no property kills -- gaps in "
              f"the suite\n{bar}")
        for r in survivors:
            print(f"  {r.mutant.name} ({r.mutant.impl}): {r.mutant.doc or 'no docstring'}"
                  f"\n    passed all {r.properties_run} property runs in {r.seconds:.0f} s")
        return EXIT_DIVERGENCE
    if undecided:
        print(f"\nNO VERDICT for {', '.join(r.mutant.name for r in undecided)}: see above")
        return EXIT_INFRA
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
