"""The structural properties' checks are total: whatever an implementation returns, a
property fails a check that says what came back (a Divergence, with its case and replay),
never by an exception of the harness's own code, which the gate can only report as its
internal error (exit 3, no case).

Each malformed implementation (tests/malformed_impls.py) runs once on a fixed case on 2
ranks, not under a hypothesis search: through the property that calls its malformed
function, which must fail the check it names, and through every other structural property
of its family, which may pass or find something (the reference's own module transform
trips over what the malformed function returned: the implementation's frame, a finding)
but must not err in the harness.
"""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from tpdp_verify.cases.tensors import FSDPCase, TensorCase
from tpdp_verify.cases.training import DDP_ENTRIES, Habits, TrainCase
from tpdp_verify.cases.trees import Node, ParamSpec, TreeCase
from tpdp_verify.judging.divergence import Divergence
from tpdp_verify.properties import (
    all_gather_dtensor_full,
    chunk_dtensor_layout,
    checkpoint_resumes,
    chunk_tensor_metadata,
    entry_points_checkpoint_resume,
    entry_points_state_dict_like_unsharded,
    flatten_roundtrip,
    fsdp_flatten_roundtrip,
    ignored_params_untouched,
    paths_resolve,
    registry_preserved,
    trains_like_one_device,
    trains_like_plain_ddp,
)
from tpdp_verify.runner.property import finding

from properties import checkpoint

import malformed_impls
import torch_mutants

# Uneven shards of two dims: rank 0's shard of two rows even unpacks as a pair.
TENSOR = TensorCase(mesh_shape=(2,), placements=(Shard(0),), shape=(3, 2), dtype=torch.float32,
                    requires_grad=True, seed=0)
TREE = TreeCase(Node("module", params=(ParamSpec("w", (3, 2), (Shard(0),), True), ParamSpec("b", (2,), None, True)),
                     children=(("layer", Node("module", params=(ParamSpec("w", (4,), (Replicate(),), False),))),)),
                mesh_shape=(2,))
FSDP_CASE = FSDPCase(mesh_shape=(1, 2), tp_placement=Shard(0), shape=(3, 2), dtype=torch.float32, seed=0)

# each structural property with the arguments it draws, fixed
DRAWN = {
    "flatten_roundtrip": {"case": TENSOR},
    "paths_resolve": {"case": TREE, "pick": 0},
    "registry_preserved": {"case": TREE, "modes": [("train", True)]},
    "ignored_params_untouched": {"case": TREE, "mask": 0b10},  # ignores the plain "b"
    "fsdp_flatten_roundtrip": {"case": TENSOR},
    "chunk_dtensor_layout": {"case": FSDP_CASE},
    "all_gather_dtensor_full": {"case": FSDP_CASE},
    "chunk_tensor_metadata": {"case": FSDP_CASE},
}
FAMILIES = [
    (malformed_impls.TRANSFORM, [flatten_roundtrip, paths_resolve, registry_preserved, ignored_params_untouched]),
    (malformed_impls.FSDP, [fsdp_flatten_roundtrip, chunk_dtensor_layout, all_gather_dtensor_full,
                            chunk_tensor_metadata]),
]
BY_NAME = {prop.name: prop for _, props in FAMILIES for prop in props}


def _raised(pool, prop, impl) -> Exception | None:
    """What running ``prop`` once on its fixed case against ``impl`` raised."""
    try:
        prop.fn(pool, f"malformed_impls.{impl.__name__}", **DRAWN[prop.name])
    except Exception as exc:  # noqa: BLE001 - judged by the test
        return exc
    return None


@pytest.mark.parametrize("impl", [i for family, _ in FAMILIES for i in family], ids=lambda i: i.__name__)
def test_the_property_calling_it_fails_a_check(tpdp_pools, impl):
    raised = _raised(tpdp_pools.get(2), BY_NAME[impl.prop], impl)
    assert isinstance(raised, Divergence), f"{type(raised).__name__}: {raised}"
    assert f"\n  {impl.caught_by} (" in str(raised), str(raised)


@pytest.mark.parametrize("impl, prop", [(i, p) for family, props in FAMILIES for i in family for p in props
                                        if p.name != i.prop],
                         ids=lambda v: getattr(v, "__name__", None) or v.name)
def test_no_other_property_errs_in_its_own_code(tpdp_pools, impl, prop):
    raised = _raised(tpdp_pools.get(2), prop, impl)
    assert raised is None or finding(raised) is not None, f"{type(raised).__name__}: {raised}"


def test_reference_passes_the_fixed_cases(tpdp_pools):
    """The fixed cases are ones the reference passes: what fails above is the malformation."""
    for name, drawn in DRAWN.items():
        BY_NAME[name].fn(tpdp_pools.get(2), "reference", **drawn)


# -- the modules a regression leaves ----------------------------------------------------
# torch's transform with one edit that unregisters the TP parameters or changes their shape
# (tests/torch_mutants.py): the rank side then meets a module missing a parameter, holding a
# plain tensor where a Parameter was, or a local shard of another shape. Every property that
# trains or checkpoints through it, on a fixed case per DDP-family entry point (the ignored
# module's averaging too), fails a check or is a finding at the code under test; the harness
# never errs in its own code (issue 42).

MALFORMING = [torch_mutants.UpdateSkipsSetattr, torch_mutants.LocalizeKeepsPlainTensors,
              torch_mutants.LocalizeFlattensTheShard]
TRAINED = [TrainCase(model="mlp", mesh_shape=(1, 2), entry=entry) for entry in DDP_ENTRIES] + [
    TrainCase(model="tied", mesh_shape=(1, 2), entry="transform_ddp"),
    # the nested model keeps a trained plain parameter beside the ignored module, so DP wraps
    # what is left and the user's averaging of the ignored module's gradients meets the module
    # as the transform left it (unregistered: nothing to average)
    TrainCase(model="nested", mesh_shape=(1, 2), entry="replicate", habits=Habits(ignored="trained")),
    TrainCase(model="mlp", mesh_shape=(1, 2), entry="transform_ddp", habits=Habits(ignored="frozen"))]
def _through(prop, route=None):
    """``prop``'s run on a case, a checkpoint's by ``route``: the property of the checkpoint
    family whose space holds the case (as the gate's draw puts it in one or the other)."""
    def run(pool, impl, case):
        if route is None:
            return prop.fn(pool, impl, case=case)
        inside = checkpoint.sound(case.entry, route, case.model, case)
        (checkpoint_resumes if inside else entry_points_checkpoint_resume).fn(pool, impl, case=case, route=route)
    run.__name__ = prop.name if route is None else f"checkpoints by {route}"
    return run


THROUGH = [_through(trains_like_one_device), _through(trains_like_plain_ddp),
           _through(entry_points_state_dict_like_unsharded), *(_through(None, r) for r in checkpoint.ROUTES)]


@pytest.mark.parametrize("mutant", MALFORMING, ids=lambda m: m.__name__)
def test_a_regression_that_unregisters_or_reshapes_parameters_is_a_finding_never_the_harnesss_error(tpdp_pools, mutant):
    found = 0
    for run in THROUGH:
        for case in TRAINED:
            try:
                run(tpdp_pools.get(2), f"torch_mutants.{mutant.__name__}", case)
            except Exception as exc:  # noqa: BLE001 - judged here
                assert finding(exc) is not None, f"{run.__name__} on {case}: {type(exc).__name__}: {exc}"
                found += 1
    assert found == len(THROUGH) * len(TRAINED)  # each run departs: the parameters are gone
