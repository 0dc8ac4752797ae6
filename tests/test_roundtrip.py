"""The round-trip property on real ranks: the reference passes, torch's divergence is
found and shrunk, and every mutant is caught."""

import time

import pytest

from tpdp_verify.cases.tensors import TensorCase, shards_unevenly
from tpdp_verify.properties import flatten_roundtrip
from tpdp_verify.properties.strategies import tensor_cases

import mutants
from helpers import divergences, the_one


@pytest.mark.parametrize("world_size", [2, 4])
def test_reference_satisfies_the_round_trip(tpdp_pools, tpdp_profile, world_size):
    stats = flatten_roundtrip.run(tpdp_pools.get(world_size), "reference", tpdp_profile)
    assert stats.passed >= tpdp_profile.max_examples and stats.discarded == 0


def test_torch_diverges_on_frozen_parameters_and_the_case_shrinks(tpdp_pool, tpdp_profile):
    """torch's _flatten_tensor calls requires_grad_() on every shard: a frozen DTensor
    parameter comes back trainable (docs/properties.md records it)."""
    found, stats = divergences(flatten_roundtrip, tpdp_pool, "torch", tpdp_profile)
    _, drawn = the_one(found, stats, "requires_grad (ranks 0, 1): unflatten(flatten(t)).requires_grad=True, "
                                     "t.requires_grad=False")
    case = drawn["case"]
    assert case.requires_grad is False and case.shape == (1,) and case.seed == 0


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=lambda m: m.__name__)
def test_every_mutant_is_caught(tpdp_pools, tpdp_profile, mutant):
    start = time.monotonic()
    found, _ = divergences(flatten_roundtrip, tpdp_pools.get(4), f"mutants.{mutant.__name__}", tpdp_profile)
    assert all(f"\n  {mutant.caught_by}" in str(e) for e in found), found
    assert time.monotonic() - start < 60


def test_the_strategy_reaches_the_interesting_cases():
    """Uneven and smaller-than-mesh shards, both placements, every dtype, frozen and not."""
    from hypothesis import given, settings

    seen = set()

    @settings(max_examples=300, database=None, derandomize=True)
    @given(case=tensor_cases(4, max_mesh_dims=2))
    def collect(case: TensorCase):
        seen.add(("uneven", shards_unevenly(case)))
        seen.add(("tiny", any(s < max(case.mesh_shape) for s in case.shape)))
        seen.add(("mesh", len(case.mesh_shape)))
        seen.update(("placement", type(p).__name__) for p in case.placements)
        seen.add(("dtype", case.dtype))
        seen.add(("requires_grad", case.requires_grad))

    collect()
    import torch

    for expected in [("uneven", True), ("uneven", False), ("tiny", True), ("mesh", 1), ("mesh", 2),
                     ("placement", "Shard"), ("placement", "Replicate"),
                     ("requires_grad", True), ("requires_grad", False),
                     *(("dtype", d) for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16))]:
        assert expected in seen, expected
