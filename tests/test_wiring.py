"""Crossed meshes on real ranks: what torch 2.13.0 refuses, and what it accepts and trains
otherwise (docs/properties.md, miswiring_refused_or_exact)."""

import pytest

from tpdp_verify.cases.training import TrainCase
from tpdp_verify.oracles.verdicts import verdict_miswired
from tpdp_verify.properties.wiring import every_group_miswiring, miswired_cases, wirings


@pytest.mark.parametrize("entry, wiring", [("ddp_mesh", "dp_over_mesh"), ("fully_shard", "dp_over_tp"),
                                           ("replicate_fsdp", "dp_over_mesh")])
def test_refused_before_training(tpdp_pools, entry, wiring):
    verdict = verdict_miswired(tpdp_pools.get(4), "torch", TrainCase(mesh_shape=(2, 2), entry=entry, wiring=wiring))
    assert verdict.ok and verdict.checks[0].name.startswith("refuses it before training"), verdict.report()


@pytest.mark.parametrize("entry, wiring", [("ddp_mesh", "dp_over_tp"), ("transform_ddp", "tp_over_dp")])
def test_accepted_and_trained_otherwise(tpdp_pools, entry, wiring):
    """Found by the property: torch takes these silently and trains something else."""
    verdict = verdict_miswired(tpdp_pools.get(4), "torch", TrainCase(mesh_shape=(2, 2), entry=entry, wiring=wiring))
    first = verdict.checks[0]
    assert not verdict.ok and not first.ok and "was accepted and trained otherwise" in first.detail, verdict.report()
    assert any(row.err.ratio > 1 for row in verdict.rows), verdict.report()


def test_every_miswiring_is_drawn_only_where_it_means_something():
    """Drawn without hypothesis's local constants, as the gate draws (tests/conftest.py): with
    them this draw moved with whichever test files its worker had run before."""
    from hypothesis import HealthCheck, given, settings

    seen = []

    @settings(max_examples=60, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(miswired_cases(4))
    def collect(case):
        seen.append(case)

    collect()
    assert seen and all(min(c.mesh_shape) > 1 and c.wiring in wirings(c.entry) for c in seen)
    # the draw gives a process group in place of the mesh (to the entry points that take one,
    # above); the cover phase gives it to each of them, which 40 drawn cases can miss
    assert any(c.wiring == "dp_by_group" for c in seen)
    covered = every_group_miswiring({"case": miswired_cases(4)})
    assert {c["case"].entry for c in covered if c["case"].wiring == "dp_by_group"} == {"ddp_mesh", "fsdp1"}


@pytest.mark.parametrize("entry, wiring, said", [("ddp_mesh", "dp_by_group", "does not have a sharding strategy"),
                                                 ("fsdp1", "dp_over_mesh", "resize_() on an invalid python storage"),
                                                 ("fsdp1", "dp_by_group", "resize_() on an invalid python storage")])
def test_an_error_that_is_not_about_the_mesh_is_a_finding(tpdp_pools, entry, wiring, said):
    """torch 2.13 raises while wrapping, before any step, but about something else than the
    mesh or group it was handed: torch failing on what it accepted, not a refusal."""
    verdict = verdict_miswired(tpdp_pools.get(4), "torch", TrainCase(mesh_shape=(2, 2), entry=entry, wiring=wiring))
    assert not verdict.ok and not verdict.checks[0].ok and said in verdict.report(), verdict.report()


def test_a_refusal_speaks_of_the_mesh_or_group():
    from tpdp_verify.oracles.verdicts import refusal

    assert refusal("wrapping with ddp_mesh: RuntimeError: Only 1D device mesh is supported, but got DeviceMesh(...)")
    assert refusal("wrapping with fully_shard: RuntimeError: Cannot concatenate overlapping meshes: [...]")
    assert refusal("wrapping with transform_ddp: RuntimeError: ('Found the DeviceMesh have 2 dimensions', ...)")
    # the stage names the entry point (ddp_mesh) and the frame a file (device_mesh.py): neither counts
    assert not refusal("wrapping with ddp_mesh: NotImplementedError: Operator c10d.broadcast_.default does not "
                       "have a sharding strategy registered. (raised in torch/distributed/device_mesh.py:f)")
    assert not refusal("wrapping with fsdp1: RuntimeError: Attempted to call resize_() on an invalid python storage.")
