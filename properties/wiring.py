"""Meshes crossed: what the entry points do when a user wires TP+DP wrong.

A drawn case is a training case on a 2-D mesh with one miswiring
(``tpdp_verify.cases.training.MISWIRINGS``): DP given mesh["tp"] or the whole mesh, DDP or
FSDP1 given the dp process group in place of the mesh, TP over mesh["dp"]. Each must be refused
before training or train exactly like one device; torch accepting one silently and
training something else (replicas averaging different shards) is the finding.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from tpdp_verify.cases.training import MISWIRINGS, TrainCase
from tpdp_verify.oracles.verdicts import verdict_miswired
from tpdp_verify.properties.training import meshes, train_cases
from tpdp_verify.runner.property import tpdp_property


def wirings(entry: str) -> tuple[str, ...]:
    """The miswirings an entry point can be given: a process group in place of the mesh is
    DDP's and FSDP1's (the entry points that take either)."""
    return tuple(w for w in MISWIRINGS if w != "dp_by_group" or entry in ("ddp_mesh", "fsdp1"))


def miswired_cases(world_size: int) -> st.SearchStrategy[TrainCase]:
    """Training cases on a mesh with both dimensions real (a miswiring on a 1-wide dimension
    crosses nothing), the optimizer built after wrapping, the entry points' first options."""
    two_d = tuple(m for m in meshes(world_size) if min(m) > 1)
    cases = train_cases(world_size, mesh_shapes=two_d, built=("after_wrap",), static_graph=(False,), options=False)
    return cases.flatmap(lambda c: st.sampled_from(wirings(c.entry)).map(lambda w: dataclasses.replace(c, wiring=w)))


@tpdp_property(min_world_size=4, case=miswired_cases)
def miswiring_refused_or_exact(pool, impl: str, case: TrainCase) -> None:
    """DP over the tp dimension or the whole mesh, DDP by process group, TP over dp: refused before training, or exact."""
    verdict_miswired(pool, impl, case).raise_if_failed()
