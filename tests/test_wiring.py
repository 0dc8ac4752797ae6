"""Crossed meshes on real ranks: what torch 2.13.0 refuses, and what it accepts and trains
otherwise (docs/properties.md, miswiring_refused_or_exact)."""

import pytest

from tpdp_verify.cases.training import TrainCase
from tpdp_verify.oracles.verdicts import verdict_miswired
from tpdp_verify.properties.wiring import miswired_cases, wirings


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
    from hypothesis import HealthCheck, given, settings

    seen = []

    @settings(max_examples=60, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
    @given(miswired_cases(4))
    def collect(case):
        seen.append(case)

    collect()
    assert seen and all(min(c.mesh_shape) > 1 and c.wiring in wirings(c.entry) for c in seen)
