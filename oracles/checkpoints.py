"""A checkpoint judged against its oracles: the unsharded model's state_dict, and the
uninterrupted run a resumed one must step exactly like.

Nothing here computes anything the oracle would have to bound: a save and a load move
bits, and the resumed model's next step runs the very computation the uninterrupted
model's runs, on the same ranks, the same rows and the same layout. So every comparison
is exact (NaN equal to NaN), and the rank pieces are put together with
tpdp_verify.ranks.pieces.merge, which checks that every copy of an element agrees.
"""

from __future__ import annotations

import math

import shutil
import tempfile
from typing import Callable

import torch

from tpdp_verify.cases.training import TrainCase
from tpdp_verify.judging.verdict import Verdict
from tpdp_verify.oracles import aside
from tpdp_verify.ranks.checkpoint import Seen, observe_checkpoint
from tpdp_verify.ranks.loop import build
from tpdp_verify.ranks.observation import Check
from tpdp_verify.ranks.pieces import merge_named, same
from tpdp_verify.signature import Signature

Explain = Callable[[Signature], bool]


# --------------------------------------------------------------------------- on the ranks


def run_checkpoint(pool, impl: str, case: TrainCase, route: str | None, tp: bool = True) -> list[Seen]:
    """``observe_checkpoint`` on every rank, with a fresh directory for DCP shared by the
    ranks (they run on this machine: under torchrun across nodes it would have to be on a
    shared filesystem)."""
    directory = tempfile.mkdtemp(prefix="tpdp-checkpoint-")
    try:
        return pool.run(observe_checkpoint, case, impl, route, directory, tp)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


# --------------------------------------------------------------------------- judging


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and same(a, b)


def _difference(a: torch.Tensor | None, b: torch.Tensor | None) -> str:
    if a is None or b is None:
        return f"{'none' if a is None else 'a tensor'} where {'none' if b is None else 'a tensor'} was expected"
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{a.dtype} of shape {list(a.shape)} where a {b.dtype} of shape {list(b.shape)} was expected"
    diff = _abs_diff(a, b)
    return f"{int((diff != 0).sum())} of {diff.numel()} elements differ, by up to {diff.max().item():.3g}"


def _abs_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise |a - b| in float64, NaN against NaN counting as equal."""
    diff = (a.double() - b.double()).abs()
    return torch.where(a.isnan() & b.isnan(), 0.0, diff) if a.is_floating_point() else diff


def _merged_label(seen: list[Seen], label: str, checks: list[Check]) -> dict:
    """The global values the ranks' pieces of ``label`` make up; a failed check per value
    whose copies disagree or whose elements no rank holds."""
    merged, problems = merge_named([s.values.get(label, {}) for s in seen])
    checks += [Check(f"replicas agree on the {label.split(' after')[0]}", False, f"{label}: {name}: {problem}")
               for name, problem in problems]
    return merged


def _compare(what: str, got: dict, expected: dict, checks: list[Check], where: str = "",
             departures: dict | None = None) -> int:
    """One exact check a value of ``expected``; missing and unexpected names fail too.
    ``departures`` gets each failed value's largest absolute difference (Verdict.departures)."""
    departures = {} if departures is None else departures
    missing = [n for n in expected if n not in got]
    extra = [n for n in got if n not in expected]
    if missing:
        checks.append(Check(what, False, f"{where}missing {', '.join(missing)}"))
        departures.update({f"{what}: {where}{n}": math.inf for n in missing})
    if extra:
        checks.append(Check(what, False, f"{where}unexpected {', '.join(extra)}"))
        departures.update({f"{what}: {where}{n}": math.inf for n in extra})
    for name in expected:
        if name in got:
            ok = _same(got[name], expected[name])
            checks.append(Check(what, ok, "" if ok else f"{where}{name}: {_difference(got[name], expected[name])}"))
            if not ok:
                departures[f"{what}: {where}{name}"] = _largest(got[name], expected[name])
    return len(expected)


def _largest(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """The largest absolute difference of two values; inf where they cannot be subtracted."""
    if a is None or b is None or a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    diff = _abs_diff(a, b)
    return float(diff.max()) if diff.numel() else 0.0


def _errors(seen: list[Seen]) -> list[Check]:
    """A failed check for each distinct exception (its type and frame), else one that passed."""
    detail = "; ".join(sorted({s.error for s in seen if s.error}))
    return [Check("every rank checkpoints without an exception", False, detail, part)
            for part in sorted({s.raised for s in seen if s.error})] or \
        [Check("every rank checkpoints without an exception", True)]


def _at_least(compared: int, seen: list[Seen], checks: list[Check]) -> None:
    """Never vacuous: at least one comparison a parameter of the model."""
    if compared < max(1, seen[0].parameters):
        checks.append(Check("compared at least one value a parameter", False,
                            f"compared {compared} values for {seen[0].parameters} parameters"))


def judge_state_dict(case: TrainCase, seen: list[Seen]) -> Verdict:
    """The state_dict() before and after training against the unsharded model's."""
    v = Verdict(against="the unsharded model's state_dict")
    v.checks += _errors(seen)
    unsharded = build(case).state_dict()
    expected = {k: tuple(t.shape) for k, t in unsharded.items()}
    compared = 0
    for moment in ("before training", "after training"):
        if moment not in seen[0].entries:
            continue
        entries = seen[0].entries[moment]
        differ = [r for r, s in enumerate(seen) if s.entries.get(moment) != entries]
        v.checks.append(Check("every rank has the same state_dict entries", not differ,
                              f"{moment}: ranks {differ} differ from rank 0"))
        keys = [k for k, _, _ in entries]
        missing, extra = [k for k in expected if k not in keys], [k for k in keys if k not in expected]
        v.checks.append(Check("state_dict has the unsharded model's keys", not missing and not extra,
                              f"{moment}: " + "; ".join(filter(None, (
                                  missing and f"missing {', '.join(missing)}",
                                  extra and f"unexpected {', '.join(extra)}")))))
        v.checks.append(Check("state_dict keys in the unsharded model's order",
                              [k for k in keys if k in expected] == [k for k in expected if k in keys],
                              f"{moment}: {keys}, unsharded {list(expected)}"))
        for key, kind, shape in entries:
            if key in expected:
                compared += 1
                v.checks.append(Check("state_dict holds global shapes", shape == expected[key],
                                      f"{moment}: {key} is a {kind} of shape {list(shape)}, "
                                      f"the unsharded model's {list(expected[key])}"))
    before = _merged_label(seen, "state_dict before training", v.checks)
    compared += _compare("state_dict before training holds the unsharded model's values", before,
                         {k: t for k, t in unsharded.items() if k in before}, v.checks)
    after = _merged_label(seen, "state_dict after training", v.checks)
    model = _merged_label(seen, "trained model", v.checks)
    model = {n[len("buffer "):] if n.startswith("buffer ") else n: t for n, t in model.items()}
    compared += _compare("state_dict after training holds the model's values", after,
                         {k: model[k] for k in after if k in model}, v.checks)
    if not v.checks[0].ok:
        return v
    _at_least(compared, seen, v.checks)
    return v


def judge_resume(case: TrainCase, seen: list[Seen]) -> Verdict:
    """The loaded model and optimizer, and the resumed step, against the uninterrupted run."""
    v = Verdict(against="the uninterrupted run")
    v.checks += _errors(seen)
    if not v.checks[0].ok:
        return v
    c, compared = v.checks, 0

    def compare(what: str, got: dict, expected: dict, where: str = "") -> int:
        return _compare(what, got, expected, c, where, v.departures)

    trained, fresh = _merged_label(seen, "trained model", c), _merged_label(seen, "fresh model", c)
    c.append(Check("the fresh model starts elsewhere", any(not _same(fresh.get(n), t) for n, t in trained.items()),
                   "the fresh model (built from another seed) already holds every trained value: "
                   "a load that moved nothing would pass"))
    compared += compare("the loaded model holds the saved values", _merged_label(seen, "loaded model", c), trained)
    compared += compare("the loaded optimizer holds the saved state", _merged_label(seen, "loaded optimizer", c),
                        _merged_label(seen, "saved optimizer", c))
    for rank, s in enumerate(seen):
        compared += compare("the loaded optimizer holds the saved state", s.local["loaded optimizer"],
                            s.local["saved optimizer"], f"rank {rank}'s flat shard: ")
        compared += compare("the resumed step's outputs and losses are the uninterrupted step's",
                            s.local["resumed step"], s.local["uninterrupted step"], f"rank {rank}: ")
        compared += compare("the resumed optimizer after the step is the uninterrupted one's",
                            s.local["resumed optimizer after the step"],
                            s.local["uninterrupted optimizer after the step"], f"rank {rank}'s flat shard: ")
    compared += compare("the resumed model after the step is the uninterrupted one's",
                        _merged_label(seen, "resumed model after the step", c),
                        _merged_label(seen, "uninterrupted model after the step", c))
    compared += compare("the resumed optimizer after the step is the uninterrupted one's",
                        _merged_label(seen, "resumed optimizer after the step", c),
                        _merged_label(seen, "uninterrupted optimizer after the step", c))
    _at_least(compared, seen, c)
    return v


def _without_tp(verdict: Verdict, pool, case: TrainCase, route: str | None, judge) -> Verdict | None:
    """The same case through the same entry point without TP; the verdict says whether
    the departure is TP+DP's or the entry point's own (None: that run failed, ``aside``)."""
    seen, failed = aside(run_checkpoint, pool, "torch", case, route, False)
    if failed:
        verdict.plain_ddp = failed
        return None
    alone = judge(case, seen)
    verdict.plain_ddp = ("checkpoints exactly: the departure is TP+DP's" if alone.ok else
                         f"departs too ({alone.kind}): the departure is {case.entry}'s own")
    return alone


def verdict_state_dict(pool, impl: str, case: TrainCase, explain: Explain = lambda signature: True) -> Verdict:
    """The state_dict the ranks read, judged; a departure ``explain`` accepts is run
    without TP too, to say whose it is."""
    verdict = judge_state_dict(case, run_checkpoint(pool, impl, case, None))
    if not verdict.ok and explain(verdict.signature):
        _without_tp(verdict, pool, case, None, judge_state_dict)
    return verdict


def verdict_resume(pool, impl: str, case: TrainCase, route: str, explain: Explain = lambda signature: True,
                   dp_own_passes: bool = False) -> Verdict:
    """A checkpoint saved, loaded and stepped on the ranks, judged; a departure ``explain``
    accepts is run without TP too, to say whose it is. With ``dp_own_passes``, a departure that the same entry point shows without TP (every
    part of it) is no departure of TP+DP's: a fresh DDP's first buckets reduce in another
    grouping than the uninterrupted run's rebuilt ones, and with more than two dp ranks
    gloo's ring sums an element in an order that depends on its place in its bucket, so
    DP alone resumes one ulp away (docs/properties.md, "Checkpoints")."""
    verdict = judge_resume(case, run_checkpoint(pool, impl, case, route))
    if verdict.ok or not (dp_own_passes or explain(verdict.signature)):
        return verdict
    alone = _without_tp(verdict, pool, case, route, judge_resume)
    if dp_own_passes and alone is not None and not alone.ok and set(verdict.signature) <= set(alone.signature) \
            and no_larger(verdict, alone):
        return Verdict(against=verdict.against, plain_ddp=verdict.plain_ddp)
    return verdict


def no_larger(verdict: Verdict, alone: Verdict) -> bool:
    """Every value TP+DP departs in departs at least as far without TP: the same rounding of
    DP's own, not a departure of TP+DP's beside it (a gradient 1% off after a load departs
    in the same checks as an ulp of gloo's ring, but by far more)."""
    return all(size <= alone.departures.get(key, -1.0) for key, size in verdict.departures.items())
