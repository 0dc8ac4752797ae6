"""verify_plan: a user's case trained on the ranks and judged against one device and
against the same DP without TP, as a ``Report``."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Callable

import torch
from torch import nn

from tpdp_verify import signature
from tpdp_verify.cases.training import TrainCase
from tpdp_verify.errors import PoolError, RankFailed, UsageError
from tpdp_verify.plan.replay import script
from tpdp_verify.plan.case import make_case
from tpdp_verify.plan.preflight import check_inputs, check_on_ranks


def verify_plan(model_fn: Callable[[], nn.Module], plan=None, *, parallelize_fn: Callable | None = None,
                mesh: tuple[int, ...] = (1, 2),
                input_fn: Callable[[int, torch.Generator], object], loss_fn: Callable | None = None,
                steps: int = 3, optimizer_fn: Callable | None = None, dp: str = "fsdp2",
                dp_alone_fn: Callable | None = None, loss_share: bool = False,
                dtype: torch.dtype = torch.float32, batch: int | None = None, accumulate: int = 1,
                ddp_options: dict | None = None, loss_parallel: bool = False, seed: int = 0,
                impl: str = "torch", pool=None, backend: str = "auto", timeout: float = 120.0,
                replay: str | None = None, baseline: str | None = None, rank_output: str | None = None,
                waiting: Callable[[str], None] | None = None):
    """Train ``model_fn()`` under ``plan`` with TP on a (dp, tp) mesh, or a (dp_replicate,
    dp_shard, tp) one, and a DP entry point, and compare it with one device and with plain
    DP; return a ``Report``.

    ``model_fn()`` builds the unsharded model from torch's global RNG (seeded with ``seed``
    first, alike on every rank). ``plan`` is what ``parallelize_module`` takes: a dict of
    module path (fnmatch wildcards per atom) -> ParallelStyle, or a function of the tp
    mesh returning one. Or, in place of a plan, ``parallelize_fn(model, mesh)``: the user's
    own function that applies TP (and any fix-up, such as re-tying weights) to the model,
    given the whole mesh as torchtitan's parallelize functions are; it returns
    the model. tpdp-verify still wraps DP per ``dp``, unless ``dp="own"``: then the function
    applies DP itself too (DDP, replicate, fully_shard or FSDP on ``mesh["dp"]``, returning
    the wrapper; over one dp rank it may apply none), tpdp-verify drives the wrapper it finds,
    and the plain-DP comparison is made with ``dp_alone_fn(model, mesh)``, the same DP
    without TP on the same mesh, or else not made (the report says so). transformers' own
    stack is both: tpdp_verify.integrations.transformers ``parallelize`` and ``dp_alone``.
    ``input_fn(n, generator)`` returns the input of ``n`` samples
    (dim 0), or a dict with it under "input" and any targets; draw from ``generator``.
    ``loss_fn(output, batch)`` returns one loss per sample (default: mean square); each is
    weighted by a random weight, which exposes DP averaging bugs that ``.sum()`` hides.
    ``loss_share``: ``loss_fn`` returns each rank's share of the step's loss (its sum over the
    global batch's count, as torchtitan's trainer divides by the step's valid tokens), which
    the DP sums (dp="own" only); the step's loss is then the shares summed over dp.
    ``optimizer_fn(params)`` builds the optimizer (default SGD, lr 0.1, momentum 0.9). ``dp``:
    fsdp2 by default (``fully_shard`` on ``mesh["dp"]``, as torchtitan composes TP: a correct
    plan passes there on torch 2.13, where DDP's transform loses TP's parameters after the
    first forward, fault 1 of docs/known-divergences.md);
    ddp (``_pre_dp_module_transform`` then DDP on the dp group), ddp_mesh (DDP with the dp
    sub-mesh), replicate, fsdp2 (``fully_shard``), fsdp1, or own (above); on a 3-D mesh fsdp2 or
    hsdp (``fully_shard`` on ``mesh["dp_replicate", "dp_shard"]``), fsdp1 or fsdp1_hybrid (FSDP1
    with HYBRID_SHARD there); spmd_shard, spmd_replicate, spmd_hsdp (3-D): ``fully_shard`` over
    the whole mesh with ``dp_mesh_dims``, the parameters DTensors on it and the batches
    DTensors sharded on dp (the plain-DP run is then that program without fully_shard).
    Runs on ``pool`` if given (its
    world size must be dp * tp), else on a pool of its own. ``baseline`` (a torch release,
    "torch==2.13.0"): a departure the run itself shows to be torch's is labelled a torch
    fault, and the report passes (status KNOWN) when nothing else departs. The evidence is
    the same case run again with tpdp-verify's reference transform in torch's place: a part
    that run does not show is torch's; every other departure is the plan's. ``rank_output``: a directory for
    the ranks' stdout and stderr (torch's warnings, C++ logs), else the terminal. ``waiting``: told in
    a line when the ranks have not answered for 10 s (tpdp_verify.ranks.pool.WAITING_NOTICE), and where
    they wait: a hang says so within seconds, not at the timeout.

    Every callable must be importable by name (module level): the ranks are other processes.
    Raises ``UsageError`` (one line) on bad input, ``PoolError`` if the ranks would not
    start. Ranks that raise, hang or die in the user's code fail the report's "trains
    without an exception" check, with each rank's traceback or stack.
    """
    from tpdp_verify.judging.verdict import Verdict
    from tpdp_verify.oracles.verdicts import verdict_one_device, verdict_plain_ddp
    from tpdp_verify.ranks.pool import RankPool
    from tpdp_verify.report import Report

    case = make_case(model_fn, plan, mesh=mesh, input_fn=input_fn, loss_fn=loss_fn, steps=steps,
                     optimizer_fn=optimizer_fn, dp=dp, dtype=dtype, batch=batch, accumulate=accumulate,
                     ddp_options=ddp_options, loss_parallel=loss_parallel, seed=seed,
                     parallelize_fn=parallelize_fn, dp_alone_fn=dp_alone_fn, loss_share=loss_share)
    if baseline:
        from tpdp_verify.runner.baseline import release_of

        release_of(baseline)  # a bad name: one line, before any rank starts
    case = check_inputs(case)
    world = case.dp * case.tp
    if pool is not None and pool.world_size != world:
        raise UsageError(f"mesh {tuple(mesh)} holds {world} ranks but the pool has {pool.world_size}; "
                         f"give a mesh whose product is {pool.world_size}, or a pool of {world}")
    owned = pool is None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if owned and world > cpus:
        warnings.warn(f"mesh {tuple(mesh)} needs {world} ranks and this machine has {cpus} CPUs: the ranks "
                      "time-share them, so the run takes longer (the verdict is the same)", stacklevel=2)
    if owned:  # the ranks' fork server imports the user's modules (transformers, say) once, for all
        from tpdp_verify.ranks.pool import warm_up

        users = (model_fn, input_fn, loss_fn, optimizer_fn, parallelize_fn, dp_alone_fn)
        warm_up(tuple(dict.fromkeys(fn.__module__ for fn in users
                                    if fn is not None and fn.__module__ not in ("__main__", "__mp_main__"))))
    pool = RankPool(world, backend, timeout=timeout, output=rank_output, waiting=waiting) if owned else pool
    keys, experts, entry, spmd = 0, 0, case.entry, case.dp_mesh_dims
    plain_run = case.entry != "own" or dp_alone_fn is not None  # the same DP without TP: torch's, or the user's
    try:
        keys, experts, entry, spmd = check_on_ranks(pool, case)
        one = verdict_one_device(pool, impl, case)
        plain = verdict_plain_ddp(pool, impl, case) if plain_run else Verdict(against="plain DDP")
    except (PoolError, RankFailed) as exc:  # ranks that raised, hung or died in the user's code
        one, plain = _did_not_finish(exc), Verdict(against="plain DDP")
    try:
        known = _torch_faults(pool, case, one, plain) if baseline and impl == "torch" else {}
    finally:
        if owned:
            pool.close()
    form = dataclasses.replace(case, entry=entry, dp_mesh_dims=spmd).dp_form if entry else ""
    by_ep = f", {experts} by EP" if experts else ""
    detail = None if parallelize_fn is None else f"parallelize_fn made {keys} parameters DTensors{by_ep}" \
        if case.entry != "own" else f"parallelize_fn sharded {keys} parameters by TP{by_ep} and " \
        + (f"wrapped DP itself ({form})" if form else "applied no DP (one dp rank)")
    return Report.of(case, keys + experts, one, plain, replay or script(case, impl, plan, baseline), detail,
                     baseline or "", known, "" if plain_run else OWN_DP)


OWN_DP = ("parallelize_fn wraps DP itself (dp='own'), so there is no run without TP to compare with (give "
          "dp_alone_fn, the same DP without TP)")


REFERENCE = "with tpdp-verify's reference transform in torch's place, the same run does not show it"
DP_ALONE = "the same DP entry point without TP departs alike: TP+DP matches it within its bound"


def _torch_faults(pool, case: TrainCase, one, plain) -> dict:
    """Per oracle, each part of a departure that the run itself shows to be torch's -> why:
    the same case with the reference transform (tpdp_verify.impls) in torch's place does not
    show it; or, against one device, the same DP without TP departs alike (TP+DP matched it,
    value by value). A part neither shows is the plan's; so is everything where the
    reference run could not be made."""
    from tpdp_verify.oracles.verdicts import verdict_one_device, verdict_plain_ddp

    runs = {"one device": (one, lambda: verdict_one_device(pool, "reference", case, lambda sig: False)),
            "plain DDP": (plain, lambda: verdict_plain_ddp(pool, "reference", case))}
    out: dict = {}
    for against, (verdict, again) in runs.items():
        if verdict.ok or not verdict.signature:
            continue
        try:
            reference = again()
        except (PoolError, RankFailed):
            continue
        out[against] = {p: REFERENCE for p in verdict.signature if p not in reference.signature}
    if not one.ok and plain.ok and (plain.checks or plain.rows):  # DP's own departure, TP added none
        out["one device"] = {p: DP_ALONE for p in one.signature} | out.get("one device", {})
    return out


def _did_not_finish(exc: BaseException):
    """A run whose ranks raised (outside the training loop, which reports its own), hung or
    died: a verdict that it did not train, with every rank's traceback or stack; the
    harness failing (ranks that would not start) is raised as it is."""
    from tpdp_verify.judging.verdict import Verdict
    from tpdp_verify.ranks.observation import Check
    from tpdp_verify.runner.property import finding

    found = finding(exc)
    if found is None and not isinstance(exc, RankFailed):
        raise exc
    part = found.signature[0] if found is not None else signature.raised_from_text(next(iter(exc.tracebacks.values())))
    if isinstance(exc, RankFailed):  # the raising rank's own words, at the user's frame: nothing of the tool's
        return Verdict([Check("trains without an exception", False, _headline(exc), part)])
    said = str(found) if found is not None else str(exc)  # a hang's or a death's: with every silent rank's stack
    return Verdict([Check("trains without an exception", False, f"{_headline(exc)}\n{said}", part)])


def _headline(exc: BaseException) -> str:
    """What happened, in the words of the first rank that raised, or the pool's for a hang or death."""
    from tpdp_verify.ranks.rank import CAUGHT_PART

    if not isinstance(exc, RankFailed):
        return str(exc).splitlines()[0]
    rank = min(exc.tracebacks)
    lines = [ln for ln in exc.tracebacks[rank].splitlines() if ln.strip()
             and not ln.startswith(CAUGHT_PART)] or [""]
    said = lines[0].removeprefix("(caught and returned) ") if "(caught and returned)" in lines[0] else lines[-1]
    waiting = f" (rank {', '.join(map(str, exc.stuck))} waited for it in a collective)" if exc.stuck else ""
    return f"rank {rank}: {said}{waiting}"
