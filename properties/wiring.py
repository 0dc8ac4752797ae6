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
from tpdp_verify.properties.training import every_entry, meshes, train_cases
from tpdp_verify.runner.property import tpdp_property


def wirings(entry: str) -> tuple[str, ...]:
    """The miswirings an entry point can be given: a process group in place of the mesh is
    DDP's and FSDP1's (the entry points that take either)."""
    return tuple(w for w in MISWIRINGS if w != "dp_by_group" or entry in BY_GROUP)


def miswired_cases(world_size: int) -> st.SearchStrategy[TrainCase]:
    """Training cases on a mesh with both dimensions real (a miswiring on a 1-wide dimension
    crosses nothing), the optimizer built after wrapping, the entry points' first options."""
    two_d = tuple(m for m in meshes(world_size) if min(m) > 1)
    cases = train_cases(world_size, mesh_shapes=two_d, built=("after_wrap",), static_graph=(False,), options=False)
    return cases.flatmap(lambda c: st.sampled_from(wirings(c.entry)).map(lambda w: dataclasses.replace(c, wiring=w)))


BY_GROUP = ("ddp_mesh", "fsdp1")  # the entry points that take a process group in place of the mesh


def every_group_miswiring(strategies: dict) -> list[dict]:
    """The MLP's simplest case through each entry point that takes a process group, given the
    dp group in place of the mesh: 40 drawn cases can miss FSDP1's."""
    return [{"case": dataclasses.replace(c, wiring="dp_by_group")} for c in every_entry(strategies, BY_GROUP)]


@tpdp_property(min_world_size=4, cover=every_group_miswiring, case=miswired_cases)
def miswiring_refused_or_exact(pool, impl: str, case: TrainCase) -> None:
    """DP over the tp dimension or the whole mesh, DDP or FSDP1 by process group, TP over dp: refused before training, or exact."""
    verdict_miswired(pool, impl, case).raise_if_failed()
