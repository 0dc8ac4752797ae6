"""The FSDP extension properties on real ranks: the reference passes, torch's divergences
are found and shrunk as docs/properties.md records them, and every mutant is caught."""

import time

import pytest
import torch
from hypothesis import given, settings
from torch.distributed.tensor import Replicate, Shard

from tpdp_verify.cases.tensors import FSDPCase
from tpdp_verify.properties.fsdp_extension import (
    all_gather_dtensor_full,
    chunk_dtensor_layout,
    chunk_tensor_metadata,
    fsdp_flatten_roundtrip,
)
from tpdp_verify.properties.strategies import fsdp_cases
from tpdp_verify.runner.property import Stats

import fsdp_mutants

PROPERTIES = {p.name: p for p in (fsdp_flatten_roundtrip, chunk_dtensor_layout, all_gather_dtensor_full,
                                  chunk_tensor_metadata)}


@pytest.mark.parametrize("name", PROPERTIES)
def test_reference_satisfies_every_property(tpdp_pools, tpdp_profile, name):
    stats = PROPERTIES[name].run(tpdp_pools.get(4), "reference", tpdp_profile)
    assert stats.passed >= tpdp_profile.max_examples and stats.discarded == 0


def _failures(run) -> tuple[str, list]:
    """Every failure message ``run()`` raised and every shrunk case: hypothesis reports
    distinct divergences apart (an ExceptionGroup) when it finds several."""
    stats = Stats()
    with pytest.raises((AssertionError, BaseExceptionGroup)) as info:
        run(stats)
    errors = info.value.exceptions if isinstance(info.value, BaseExceptionGroup) else (info.value,)
    cases = [f["case"] for f in stats.failures.values()] or [stats.failing["case"]]
    return "\n".join(map(str, errors)), cases


def _torch_failure(pool, prop, profile) -> tuple[str, list]:
    return _failures(lambda stats: prop.run(pool, "torch", profile, stats))


def test_torch_flatten_flips_the_shards_requires_grad(tpdp_pools, tpdp_profile):
    """The same _flatten_tensor as DDP's (flatten_roundtrip): even for a trainable
    parameter, its own shard (t.to_local()) starts requiring grad."""
    message, cases = _torch_failure(tpdp_pools.get(4), fsdp_flatten_roundtrip, tpdp_profile)
    assert "pre_flatten leaves t's shard requiring grad as before (ranks 0, 1, 2, 3): " \
           "t's shard requires_grad went False -> True" in message
    assert any(case.shape == (1,) and case.seed == 0 for case in cases)


def test_torch_chunk_dtensor_diverges(tpdp_pools, tpdp_profile):
    """from_local without the global shape: ranks disagree on an uneven tp shard."""
    message, cases = _torch_failure(tpdp_pools.get(4), chunk_dtensor_layout, tpdp_profile)
    assert "chunk_dtensor agrees on the global shape on every rank before communicating" in message
    assert FSDPCase(mesh_shape=(1, 4), tp_placement=Shard(0), shape=(1,), dtype=torch.float32, seed=0) in cases


def test_torch_chunk_dtensor_shards_plain_tensors_over_hsdp_replicas(tpdp_pools):
    """Hidden behind the shape divergence, so replayed on its own: a (1, 2, 2) mesh."""
    case = FSDPCase(mesh_shape=(1, 2, 2), tp_placement=None, shape=(2,), dtype=torch.float32, seed=0)
    with pytest.raises(AssertionError) as info:
        chunk_dtensor_layout.fn(tpdp_pools.get(4), "torch", case=case)
    assert "chunk_dtensor placements (ranks 0, 1, 2, 3): (Shard(dim=0), Replicate(), Replicate()) != " \
           "(Replicate(), Shard(dim=0), Replicate())" in str(info.value)


def test_torch_all_gather_dtensor_holds(tpdp_pools, tpdp_profile):
    stats = all_gather_dtensor_full.run(tpdp_pools.get(4), "torch", tpdp_profile)
    assert stats.passed >= tpdp_profile.max_examples


def test_torch_chunk_tensor_places_shards_on_group_ranks(tpdp_pools, tpdp_profile):
    """The local shard's placement is its rank in the tp group, which ShardedTensor reads
    as a global rank: wrong wherever the tp group is not the world's first ranks."""
    message, cases = _torch_failure(tpdp_pools.get(4), chunk_tensor_metadata, tpdp_profile)
    assert "chunk_tensor runs (ranks 2, 3): ValueError: Global rank 0 does not exist in input process " \
           "group: [2, 3]" in message
    assert FSDPCase(mesh_shape=(2, 2), tp_placement=Replicate(), shape=(1,), dtype=torch.float32, seed=0) in cases


def test_torch_chunk_tensor_misplaces_the_local_block(tpdp_pools):
    """Even tp shards on a (2, 2) mesh: rank 1's block is listed as rank 0's."""
    case = FSDPCase(mesh_shape=(2, 2), tp_placement=Shard(0), shape=(2,), dtype=torch.float32, seed=0)
    with pytest.raises(AssertionError) as info:
        chunk_tensor_metadata.fn(tpdp_pools.get(4), "torch", case=case)
    assert "chunk_tensor local shard is listed in the metadata (rank 1): ((1,), (1,)) on rank:1/cpu is not in " \
           "the global metadata" in str(info.value)


def test_torch_chunk_tensor_overlaps_uneven_shards(tpdp_pools):
    """Floor-sized offsets (3 // 4 = 0) for an uneven tp shard: the blocks of the ranks that
    hold a row overlap, and the rank that holds none finds the shards do not cover the tensor."""
    case = FSDPCase(mesh_shape=(1, 4), tp_placement=Shard(0), shape=(3,), dtype=torch.float32, seed=0)
    with pytest.raises(AssertionError) as info:
        chunk_tensor_metadata.fn(tpdp_pools.get(4), "torch", case=case)
    lines = str(info.value).splitlines()
    assert any(line.startswith("  chunk_tensor runs (ranks 0, 1, 2): ValueError: Shards ShardMetadata")
               and "overlap (raised in torch/" in line for line in lines), lines
    assert any(line.startswith("  chunk_tensor runs (rank 3): ValueError: Total volume of shards: 0 does not match "
                               "tensor volume: 3, in other words all the individual shards do not cover the entire "
                               "tensor (raised in torch/") for line in lines), lines


@pytest.mark.parametrize("mutant", fsdp_mutants.MUTANTS, ids=lambda m: m.__name__)
def test_every_mutant_is_caught(tpdp_pools, tpdp_profile, mutant):
    start = time.monotonic()
    message, _ = _failures(lambda stats: PROPERTIES[mutant.prop].run(
        tpdp_pools.get(4), f"fsdp_mutants.{mutant.__name__}", tpdp_profile, stats))
    assert f"\n  {mutant.caught_by} (" in message
    assert time.monotonic() - start < 60


def test_the_strategy_reaches_the_interesting_cases():
    """On 4 ranks: 2-D and 3-D meshes with every dim above 1 somewhere, plain tensors and
    both tp placements, uneven and smaller-than-mesh tp shards."""
    seen = set()

    @settings(max_examples=300, database=None, derandomize=True)
    @given(case=fsdp_cases(4))
    def collect(case: FSDPCase):
        seen.add(("mesh", len(case.mesh_shape)))
        seen.add(("mesh", case.mesh_shape))
        seen.add(("tp", type(case.tp_placement).__name__))
        if isinstance(case.tp_placement, Shard):
            n, size = case.mesh_shape[-1], case.shape[case.tp_placement.dim]
            seen.add(("uneven", bool(size % n)))
            seen.add(("tiny", size < n))

    collect()
    for expected in [("mesh", 2), ("mesh", 3), ("mesh", (2, 2)), ("mesh", (2, 1, 2)), ("mesh", (1, 2, 2)),
                     ("tp", "NoneType"), ("tp", "Shard"), ("tp", "Replicate"),
                     ("uneven", True), ("uneven", False), ("tiny", True)]:
        assert expected in seen, expected


@pytest.mark.timeout(600)
def test_hsdp_on_eight_ranks(tpdp_pools):
    """The release profile's world size: a (2, 2, 2) mesh, every dim above 1."""
    pool = tpdp_pools.get(8)
    even = FSDPCase(mesh_shape=(2, 2, 2), tp_placement=Shard(1), shape=(4, 6), dtype=torch.float32, seed=0)
    plain = FSDPCase(mesh_shape=(2, 2, 2), tp_placement=None, shape=(5, 3), dtype=torch.float32, seed=1)
    for case in (even, plain):
        chunk_dtensor_layout.fn(pool, "reference", case=case)
        all_gather_dtensor_full.fn(pool, "reference", case=case)
    chunk_dtensor_layout.fn(pool, "torch", case=even)
    with pytest.raises(AssertionError, match="chunk_dtensor placements"):
        chunk_dtensor_layout.fn(pool, "torch", case=plain)
    all_gather_dtensor_full.fn(pool, "torch", case=plain)
