"""TP's sums of partial gradients judged against the policy's reduce_dtype
(tpdp_verify.judging.reductions): exact where the sum ran in float32, a departure where it
ran in bfloat16, nothing claimed where nothing was reduced."""

import dataclasses

import pytest
import torch

from tpdp_verify.cases.training import FSDP2Options, TrainCase
from tpdp_verify.judging.reductions import judge_reductions, reduce_dtype
from tpdp_verify.ranks.loop import Trace
from tpdp_verify.ranks.reductions import Reduction

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
