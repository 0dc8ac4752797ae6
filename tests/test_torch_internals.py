"""What tpdp-verify reads of torch's private state goes through tpdp_verify.torch_internals:
on the pinned torch every read finds its thing; a release that renamed one (2.15.0 moved
FSDP2's mixed-precision policy from the parameter group to each parameter) is read by its
own name; a release with none of the names known says what cannot be observed, in one
line, never an AttributeError from inside a rank."""

import types

import pytest
import torch

from tpdp_verify import torch_internals
from tpdp_verify.torch_internals import Unobservable


@pytest.mark.parametrize("name", sorted(torch_internals.SITES))
def test_every_site_resolves_on_the_pinned_torch(name):
    owner, attribute = torch_internals.site(name)
    assert callable(getattr(owner, attribute))


def test_a_site_this_torch_lacks_is_unobservable_in_one_line(monkeypatch):
    monkeypatch.setitem(torch_internals.SITES, "grad step", (("torch.distributed.fsdp", "FSDPParam.no_such_step"),))
    with pytest.raises(Unobservable) as caught:
        torch_internals.site("grad step")
    said = str(caught.value)
    assert said.startswith(f"cannot observe FSDP2's grad step on torch {torch.__version__}: it has no ")
    assert "\n" not in said and "FSDPParam.no_such_step" in said


def test_the_policy_is_read_by_each_releases_name():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    up_to_2_14 = types.SimpleNamespace(mp_policy=policy)  # FSDPParamGroup.mp_policy
    since_2_15 = types.SimpleNamespace(fsdp_params=[types.SimpleNamespace(mp_policy=policy)] * 2)  # FSDPParam's
    assert torch_internals.fsdp2_policies(up_to_2_14) == [policy]
    assert torch_internals.fsdp2_policies(since_2_15) == [policy, policy]
    with pytest.raises(Unobservable, match="mixed-precision policy .* it has no SimpleNamespace.fsdp_params"):
        torch_internals.fsdp2_policies(types.SimpleNamespace())


def test_the_precision_line_leaves_out_what_it_cannot_see():
    """A report's "mixed precision" line is no check: on a torch that keeps the policy under no
    name known, it names what it can see, and the run goes on."""
    from torch import nn

    from tpdp_verify.ranks.entries import precision

    class Unit(nn.Linear):  # an FSDP2 unit whose groups keep their policy under no name known
        def _get_fsdp_state(self):
            return types.SimpleNamespace(_fsdp_param_groups=[types.SimpleNamespace()])

    assert precision(nn.Sequential(Unit(2, 2))) == []


def test_param_groups_of_a_unit_with_one_group_or_a_list():
    group = object()
    assert torch_internals.fsdp2_param_groups(types.SimpleNamespace(_fsdp_param_groups=[group])) == (group,)
    assert torch_internals.fsdp2_param_groups(types.SimpleNamespace(_fsdp_param_group=group)) == (group,)
    assert torch_internals.fsdp2_param_groups(types.SimpleNamespace(_fsdp_param_group=None)) == ()
