"""TP's sums of partial gradients, and DP's means of the ranks' gradients, judged against
the policy's reduce_dtype (tpdp_verify.judging.reductions): exact where the sum ran in
float32, a departure where it ran in bfloat16, nothing claimed where nothing was reduced."""

import dataclasses

import pytest
import torch

from tpdp_verify.cases.training import FSDP2Options, TrainCase
from tpdp_verify.judging.reductions import judge_dp_reductions, judge_reductions, reduce_dtype
from tpdp_verify.ranks.loop import Trace
from tpdp_verify.ranks.reductions import DPReduction, Reduction

POLICY = TrainCase(model="llama_sp", mesh_shape=(1, 2), entry="fully_shard", fsdp=FSDP2Options(mixed_precision="bfloat16"))


def traces(sum_dtype: torch.dtype, case: TrainCase = POLICY, n: int = 64) -> list[Trace]:
    """Two tp ranks' partial sums in bfloat16, as a step's gradients are, each given the sum in ``sum_dtype``."""
    gen = torch.Generator().manual_seed(0)
    partials = [torch.randn(n, generator=gen).bfloat16() for _ in range(case.tp)]
    total = sum(p.to(sum_dtype) for p in partials)
    return [Trace(reductions=[Reduction("norm.weight", p, total)]) for p in partials]


def test_a_sum_in_float32_of_bfloat16_partials_passes_where_float32_is_asked():
    [check] = judge_reductions(POLICY, traces(torch.float32))
    assert check.ok and check.name == "TP sums a step's gradients in the reduce dtype", check


def test_a_sum_in_bfloat16_departs_where_float32_is_asked_by_orders_of_magnitude():
    [check] = judge_reductions(POLICY, traces(torch.bfloat16))
    assert not check.ok and "2 of 2 reductions depart: norm.weight" in check.detail, check


def test_without_a_policy_the_gradients_own_dtype_is_the_reduce_dtype():
    case = dataclasses.replace(POLICY, fsdp=FSDP2Options(), dtype="bfloat16")
    assert reduce_dtype(case) == torch.bfloat16
    [check] = judge_reductions(case, traces(torch.bfloat16, case))
    assert check.ok, check


def test_the_path_through_fsdp2_names_the_check():
    [check] = judge_reductions(dataclasses.replace(POLICY, accumulate=2), traces(torch.float32))
    assert check.name == "TP sums gradients accumulated over microbatches in the reduce dtype"


@pytest.mark.parametrize("records", [[], [Reduction("w", torch.ones(4), torch.ones(2))]],
                         ids=["nothing reduced", "a reduce-scatter to a shard"])
def test_no_check_claims_what_was_not_compared(records):
    assert judge_reductions(POLICY, [Trace(reductions=records), Trace(reductions=records)]) == []


DP_POLICY = dataclasses.replace(POLICY, mesh_shape=(4, 1))


def dp_traces(mean_dtype: torch.dtype, shards: int = 4, replicas: int = 1, rows: int = 9) -> list[Trace]:
    """``shards * replicas`` dp ranks' bfloat16 gradients of 9 rows (a last shard short of
    rows, as torch.chunk splits them), each rank given its rows of the mean made in ``mean_dtype``."""
    gen = torch.Generator().manual_seed(0)
    world = shards * replicas
    grads = [torch.randn(rows, 3, generator=gen).bfloat16() for _ in range(world)]
    mean = (sum(g.to(mean_dtype) for g in grads) / world).float()
    size = -(-rows // shards)
    out = []
    for rank in range(world):
        group = tuple(range(rank // shards * shards, rank // shards * shards + shards))
        others = tuple(range(rank % shards, world, shards)) if replicas > 1 else ()
        at = group.index(rank)
        shard = mean[at * size:(at + 1) * size]
        out.append(Trace(dp_reductions=[DPReduction("w", grads[rank], shard, shard, group, others, None)]))
    return out


@pytest.mark.parametrize("replicas", [1, 2], ids=["FSDP", "HSDP"])
def test_dp_means_in_float32_pass_and_in_bfloat16_depart(replicas):
    [exact] = judge_dp_reductions(DP_POLICY, dp_traces(torch.float32, replicas=replicas))
    [rounded] = judge_dp_reductions(DP_POLICY, dp_traces(torch.bfloat16, replicas=replicas))
    assert exact.ok and exact.name == "DP sums gradients in the reduce dtype", exact
    assert not rounded.ok and f"of {4 * replicas} reductions depart: w on rank" in rounded.detail, rounded


def test_a_dp_reduction_that_left_no_gradient_or_another_shape_or_was_made_elsewhere_departs():
    for broken in (lambda r: r._replace(delta=None), lambda r: r._replace(delta=r.delta[:1]),
                   lambda r: r._replace(name="v")):
        ranks = dp_traces(torch.float32)
        ranks[1].dp_reductions = [broken(ranks[1].dp_reductions[0])]
        [check] = judge_dp_reductions(DP_POLICY, ranks)
        assert not check.ok, check


def test_no_dp_check_claims_what_was_not_reduced():
    assert judge_dp_reductions(DP_POLICY, [Trace(), Trace()]) == []
