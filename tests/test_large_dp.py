"""The DP that large models train with (properties/large_dp.py): the ci profile draws every
form of it, its oracles are sound, FSDP1's keywords listed as changing nothing change
nothing, and regressions in FSDP2's HSDP are NEW against torch 2.13.0."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from tpdp_verify.cases.training import FSDP1_FLAT, FSDP1_HYBRID, LOSS_REDUCTIONS, SPMD_FORMS, Loss, TrainCase
from tpdp_verify.judging.verdict import assemble, judge_training
from tpdp_verify.oracles.plain_ddp import observe_plain_ddp
from tpdp_verify.oracles.single_device import oracle
from tpdp_verify.properties.large_dp import large_dp_trains_like_one_device, large_dp_trains_like_plain_dp
from tpdp_verify.ranks.tp_dp import observe
from tpdp_verify.runner import profiles
from tpdp_verify.runner.baseline import Baseline
from tpdp_verify.runner.gate import judged_search

import torch_mutants  # after torch's FSDP has loaded through tpdp_verify: its import order

CI = profiles.PROFILES["ci"]
LARGE_DP = (large_dp_trains_like_one_device, large_dp_trains_like_plain_dp)


@functools.cache
def drawn(world_size: int) -> tuple[TrainCase, ...]:
    """The cases both properties train under the ci profile, cover cases first (the gate's
    own draw: a recorder in place of the ranks)."""
    seen = []
    for prop in LARGE_DP:
        @functools.wraps(prop.fn)
        def record(pool, impl, case):
            seen.append(case)

        dataclasses.replace(prop, fn=record).run(SimpleNamespace(world_size=world_size), "torch", CI)
    return tuple(seen)


def test_the_ci_profile_draws_every_form_with_tp_and_dp_composed():
    cases = drawn(4)
    assert len(cases) >= 2 * 10  # each property's 10 drawn cases, beside its cover cases
    forms = Counter(f"{c.dp_form} on {'3-D' if len(c.mesh_shape) == 3 else '2-D'}" for c in cases)
    expected = ([f"fsdp1({s}) on 3-D" for s in FSDP1_HYBRID] + [f"fsdp1({s}) on 2-D" for s in FSDP1_FLAT]
                + ["fully_shard on 3-D"]
                + [f"fully_shard(dp_mesh_dims={f}) on {d}" for f in SPMD_FORMS for d in ("2-D", "3-D")
                   if f != "both" or d == "3-D"]
                + [f"replicate_fsdp(dp_mesh_dims=replicate) on {d}" for d in ("2-D", "3-D")])
    assert all(forms[f] for f in expected), [f for f in expected if not forms[f]]
    meshes = Counter(c.mesh_shape for c in cases)
    assert meshes[(2, 1, 2)] and meshes[(1, 2, 2)], meshes  # each dp dimension real beside tp
    assert sum(c.dp > 1 and c.tp > 1 for c in cases) > len(cases) / 2, meshes
    spmd = [c for c in cases if c.dp_mesh_dims]
    assert {c.loss_reduction for c in spmd} == set(LOSS_REDUCTIONS)
    assert any(c.fsdp.shard_dim == 1 for c in spmd) and any(c.fsdp.shard_dim == 1 and not c.dp_mesh_dims
                                                            for c in cases)
    fsdp1 = {(c.fsdp1.auto_wrap, c.fsdp1.mixed_precision is not None) for c in cases if c.entry == "fsdp1"}
    assert fsdp1 == {(False, False), (True, False), (False, True), (True, True)}, fsdp1  # its keywords, each way


def test_the_ci_profile_checkpoints_hsdp_and_the_spmd_form_by_every_route():
    from tpdp_verify.properties.large_dp import large_dp_checkpoint_resumes

    seen = []

    @functools.wraps(large_dp_checkpoint_resumes.fn)
    def record(pool, impl, case, route):
        seen.append((case.dp_form, case.mesh_shape, route))

    dataclasses.replace(large_dp_checkpoint_resumes, fn=record).run(SimpleNamespace(world_size=4), "torch", CI)
    from tpdp_verify.ranks.checkpoint import ROUTES

    assert {(f, r) for f, m, r in seen if m == (2, 1, 2)} >= {(f, r) for f in ("fully_shard", "fsdp1(HYBRID_SHARD)")
                                                               for r in ROUTES}, seen
    assert {(f, r) for f, m, r in seen} >= {(f"fully_shard(dp_mesh_dims={f})", r) for f in SPMD_FORMS for r in ROUTES}


def test_the_cases_are_drawn_on_8_ranks_too():
    """The release profile's world size 8 reaches the 2 x 2 x 2 mesh, every dimension real."""
    shapes = Counter(c.mesh_shape for c in drawn(8))
    assert shapes[(2, 2, 2)] > 0, shapes


def _judged(pool, fn, case, *args):
    whole, checks = assemble(case, pool.run(fn, case, *args))
    verdict = judge_training(case, whole, *oracle(case))
    verdict.checks[:0] = checks
    return verdict


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh, form", [((2, 2), "shard"), ((2, 1, 2), "both")])
def test_the_spmd_oracle_trains_like_one_device(tpdp_pools, mesh, form):
    """The SPMD form's oracle, the DTensor program with no DP wrapper (DTensor reducing the
    gradients over dp itself), trains exactly like one device, with each loss reduction:
    where fully_shard departs from it, the departure is fully_shard's."""
    for reduction in LOSS_REDUCTIONS:
        case = TrainCase(model="mlp", mesh_shape=mesh, entry="fully_shard", dp_mesh_dims=form, steps=2,
                         accumulate=2, loss_reduction=reduction)
        verdict = _judged(tpdp_pools.get(4), observe_plain_ddp, case)
        assert verdict.ok and len(verdict.rows) > 0, verdict.report()


@pytest.mark.timeout(300)
def test_fsdp1_keywords_that_order_its_collectives_change_no_value(tpdp_pools):
    """backward_prefetch, forward_prefetch and limit_all_gathers, which the gate lists as not
    set on purpose (tpdp_verify.runner.coverage): FSDP1 with TP trains bit for bit as without them."""
    from torch.distributed.fsdp import BackwardPrefetch

    from rank_fns import observe_fsdp1_with

    pool = tpdp_pools.get(4)
    for case in (TrainCase(model="mlp", mesh_shape=(2, 2), entry="fsdp1", steps=2),
                 TrainCase(model="llama", mesh_shape=(1, 2, 2), entry="fsdp1", fsdp1_strategy="HYBRID_SHARD", steps=2)):
        plain = [t for t in pool.run(observe, case, "torch")]
        ordered = pool.run(observe_fsdp1_with, case, "torch", {"backward_prefetch": BackwardPrefetch.BACKWARD_POST,
                                                              "forward_prefetch": True, "limit_all_gathers": False})
        assert not any(t.error for t in plain), plain[0].error
        compared = 0
        for a, b in zip(plain, ordered):
            for steps_a, steps_b in ((a.grads, b.grads), (a.params, b.params)):
                for x, y in zip(steps_a, steps_b):
                    assert x.keys() == y.keys()
                    for name in x:
                        compared += 1
                        assert torch.equal(_tensor(x[name]), _tensor(y[name])), (case, name)
        assert compared > 0


def _tensor(value):
    """A value as a rank holds it: a whole tensor, or its Piece's local elements."""
    from tpdp_verify.ranks.pieces import Piece

    return value.local if isinstance(value, Piece) else value


def _new_against_the_release(pool, mutant, prop):
    """The mutant's search (unshrunk: its power, not shrinking's), judged by torch 2.13.0 on
    each failure's own case; the memo's other failing cases are not rerun (FIXED's search:
    tests/test_baseline.py)."""
    release = Baseline("2.13.0", install=False)
    profile = dataclasses.replace(CI, shrink=False, rerun_total=0.0)
    try:
        return judged_search(prop, pool, f"torch_mutants.{mutant.__name__}", profile, release)
    finally:
        release.close()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mutant, part", [
    (torch_mutants.HSDPSkipsReplicateAllReduce, "check:replicas-agree-on-grads"),
    (torch_mutants.ShardReduceScatterScaled, "value:gradient"),
], ids=lambda v: getattr(v, "__name__", v))
def test_a_regression_in_fsdp2s_hsdp_is_new_against_the_release(tpdp_pools, mutant, part):
    """The dp_replicate all-reduce skipped, and a dp_shard reduce-scatter whose result is
    scaled: each NEW on cases where torch 2.13.0 trains exactly."""
    outcome = _new_against_the_release(tpdp_pools.get(4), mutant, large_dp_trains_like_one_device)
    new = [f for f in outcome.findings if f.status == "NEW" and part in f.signature]
    assert outcome.status == "diverges" and new, outcome.findings
    assert all(f.replay for f in outcome.findings if f.status == "NEW")


@pytest.mark.timeout(300)
def test_the_spmd_forms_checkpoints_read_its_buffers_whole(tpdp_pools):
    """The SPMD form's buffers are DTensors on the whole mesh: each rank reads them whole, so
    the parent merges tensors (a DTensor reaching it was an internal error at release)."""
    from tpdp_verify.oracles.checkpoints import verdict_state_dict
    from tpdp_verify.runner.property import worth_explaining

    case = TrainCase(model="buffers", mesh_shape=(2, 2), entry="fully_shard", dp_mesh_dims="shard")
    verdict = verdict_state_dict(tpdp_pools.get(4), "torch", case, worth_explaining)
    assert verdict.ok and len(verdict.checks) > 20, verdict.report()


@pytest.mark.timeout(300)
def test_dtensor_refuses_a_batch_that_does_not_divide_where_a_layer_flattens_it(tpdp_pools):
    """Why the uneven SPMD batches (properties/training.py uneven_batches) are the MLP's: a
    Linear over a (batch, seq, dim) DTensor flattens its batch dims, which DTensor refuses
    where the batch does not divide over its mesh dim; the same batch of a sample fewer trains
    the MLP exactly, and the sequence model trains on an even batch."""
    from tpdp_verify.properties.losses import EDGE_SIZE

    pool = tpdp_pools.get(4)
    spmd = dict(entry="dtensor", dp_mesh_dims="replicate", mesh_shape=(2, 2), local_batch=2)
    sequence = TrainCase(model="lm_head", size=EDGE_SIZE, loss=Loss(reduction="sum", parallel=False, over="batch"),
                         **spmd)
    short = dataclasses.replace(sequence, batch_short=1)
    raised = {t.error for t in pool.run(observe, short, "torch")}
    assert all("Cannot flatten unevenly sharded tensor" in e for e in raised), raised
    for case in (sequence, TrainCase(model="mlp", batch_short=1, **spmd)):
        verdict = _judged(pool, observe, case, "torch")
        assert verdict.ok and len(verdict.rows) > 0, verdict.report()


def test_a_dp_ranks_rows_are_torch_chunks_of_chunks_in_rank_order():
    """TrainCase.rows, the rows each dp rank takes of a batch that does not divide over the
    dp dims (batch_short): torch.chunk on each dp dim in turn, outer first, a rank past the
    last chunk empty (as DTensor's Shard(0) lays them out); the ranks' rows tile the batch."""
    def chunks(t, n):
        got = list(torch.chunk(t, n))
        return got + [t[:0]] * (n - len(got))

    for mesh in ((2, 1), (4, 2), (2, 2, 1), (2, 3, 2)):
        for short in range(math.prod(mesh[:-1]) * 2):
            case = TrainCase(mesh_shape=mesh, entry="dtensor", dp_mesh_dims="replicate", batch_short=short)
            pieces = [torch.arange(case.global_batch)]
            for size in mesh[:-1]:
                pieces = [c for p in pieces for c in chunks(p, size)]
            assert [torch.arange(case.global_batch)[case.rows(d)].tolist() for d in range(case.dp)] == \
                [p.tolist() for p in pieces], (mesh, short)
    with pytest.raises(ValueError, match="needs the SPMD form"):
        TrainCase(mesh_shape=(2, 2), batch_short=1)
