"""A TP+DP case judged against each oracle: one device, and plain DP without TP."""

from __future__ import annotations

import re
from typing import Callable

from tpdp_verify.cases.training import DTENSOR, MISWIRINGS, TrainCase
from tpdp_verify.judging.verdict import Verdict, assemble, handed_on_shard, judge_training, localize, upstream
from tpdp_verify.oracles import aside
from tpdp_verify.oracles.plain_ddp import observe_plain_ddp, observe_with_plain_ddp
from tpdp_verify.oracles.single_device import oracle
from tpdp_verify.ranks.observation import Check
from tpdp_verify.ranks.tp_dp import observe
from tpdp_verify.signature import Signature


def _explain(verdict: Verdict, pool, impl: str, case: TrainCase) -> None:
    """Run the case again with every module's output recorded, to name where it departs,
    and without TP through the same entry point, to say whether DP alone departs too
    (each run ``aside``: what it meets is not the case's finding)."""
    traces, _ = aside(pool.run, observe, case, impl, True)
    if traces and all(t.activations for t in traces):
        rounded, shadow = oracle(case, capture=True)
        if any(t.error for t in traces):  # a raise after the forward: a head that hands on its shard?
            handed = handed_on_shard(traces[0], shadow) if not any(t.raised_in for t in traces) else None
            if handed:
                verdict.first_module, verdict.cause = handed
                verdict.module_is = "first module whose output has another shape than the unsharded model's"
        elif any(not r.err.ok for r in verdict.rows):  # a module departs only where values do
            verdict.first_module = localize(traces, case, rounded, shadow)
            verdict.cause = upstream(verdict.first_module, shadow) if verdict.first_module else ""
    if case.entry in ("own", DTENSOR):  # DP wrapped by the user's function with TP; or no wrapper to leave out
        return
    if case.dp_mesh_dims:
        verdict.beside = f"the same DTensor program without {case.entry}"
    observed, failed = aside(pool.run, observe_plain_ddp, case)
    if failed:
        verdict.plain_ddp = failed
        return
    plain, checks = assemble(case, observed)
    alone = judge_training(case, plain, *oracle(case))
    alone.checks[:0] = checks
    verdict.plain_ddp = f"trains like one device: the departure is {case.entry if case.dp_mesh_dims else 'TP+DP'}'s" \
        if alone.ok else \
        f"departs too ({alone.kind}): the departure is {'DTensor' if case.dp_mesh_dims else case.entry}'s own"


def verdict_one_device(pool, impl: str, case: TrainCase,
                       explain: Callable[[Signature], bool] = lambda signature: True) -> Verdict:
    """The case on the ranks, judged against one device; a departure ``explain`` accepts is
    run twice more, to name the first module that departs and to run it without TP."""
    whole, checks = assemble(case, pool.run(observe, case, impl))
    rounded, shadow = oracle(case)
    verdict = judge_training(case, whole, rounded, shadow)
    verdict.checks[:0] = checks
    if not verdict.ok and explain(verdict.signature):
        _explain(verdict, pool, impl, case)
    return verdict


def verdict_plain_ddp(pool, impl: str, case: TrainCase) -> Verdict:
    """The case on the ranks and without TP through the same entry point, in one call,
    judged against each other within the bound plain DDP earns."""
    traces = pool.run(observe_with_plain_ddp, case, impl)
    tpdp, tp_checks = assemble(case, [t for t, _ in traces])
    plain, plain_checks = assemble(case, [p for _, p in traces])
    _, shadow = oracle(case)
    if plain.error:  # plain DDP refuses the case: TP+DP must refuse it the same way
        return Verdict([Check("refuses what plain DDP refuses", bool(tpdp.error),
                              f"plain DDP raised {plain.error!r}; TP+DP {tpdp.error or 'trained'}")],
                       against="plain DDP")
    if not all(c.ok for c in plain_checks):  # the entry point alone breaks its own contract: no oracle to judge by
        failed = "; ".join(f"{c.name}: {c.detail}" for c in plain_checks if not c.ok)
        return Verdict([Check("the same DP without TP keeps its replicas in step", False, failed)],
                       against="plain DDP")
    verdict = judge_training(case, tpdp, plain, shadow, against="plain DDP")
    verdict.checks[:0] = tp_checks
    return verdict


# What a refusal of a crossed mesh talks about: torch's own words for the mesh or group it
# was handed ("Only 1D device mesh is supported", "Cannot concatenate overlapping meshes")
_ABOUT_WIRING = re.compile(r"mesh|process ?group", re.I)


def refusal(error: str) -> bool:
    """Whether a rank's error is a refusal of the wiring: its exception's message (not the
    stage, which names the entry point, nor the frame) speaks of the mesh or the group. An
    error about anything else (an operator with no sharding strategy, an invalid storage)
    is torch failing on what it accepted: a finding."""
    message = error.split("Error: ", 1)[-1].rsplit(" (raised in ", 1)[0]
    return bool(_ABOUT_WIRING.search(message))


def verdict_miswired(pool, impl: str, case: TrainCase) -> Verdict:
    """A miswired case (TrainCase.wiring): refused on every rank before the first step, with
    an error about the mesh or group, or trained exactly like one device; anything else is
    torch accepting the miswiring."""
    traces = pool.run(observe, case, impl)
    wired = MISWIRINGS[case.wiring]
    if all(t.error and len(t.params) <= 1 and refusal(t.error) for t in traces):  # before any step completed
        return Verdict([Check(f"refuses it before training ({wired})", True)], against="one device")
    whole, checks = assemble(case, traces)
    verdict = judge_training(case, whole, *oracle(case))
    verdict.checks[:0] = checks
    verdict.checks.insert(0, Check("refuses a miswiring before training, or trains exactly", verdict.ok,
                                   f"{wired} was accepted" + ("" if any(t.error for t in traces) else
                                                              " and trained otherwise than one device")))
    return verdict
