"""What the user tells DP to ignore comes out of wrapping and training as the user left it
(Habits.ignored): the same object, still the DTensor TP made it. A check of every training
case that draws an ignore list, at every entry point that takes one."""

import pytest

from tpdp_verify.cases.training import Habits, Size, TrainCase
from tpdp_verify.oracles.verdicts import verdict_one_device

CHECK = "what DP is told to ignore stays as the user left it"


def case(entry: str, ignored: str = "trained") -> TrainCase:
    return TrainCase(model="mlp", size=Size(dim=4, hidden=4, heads=2, vocab=16, seq=4), mesh_shape=(2, 2),
                     entry=entry, habits=Habits(ignored=ignored), steps=2)


def made(verdict) -> list:
    return [c for c in verdict.checks if c.name == CHECK]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("entry", ["fully_shard", "replicate_fsdp", "fsdp1"])
def test_fsdp_entry_points_leave_what_they_ignore_alone(tpdp_pools, entry):
    verdict = verdict_one_device(tpdp_pools.get(4), "torch", case(entry))
    assert [c.ok for c in made(verdict)] == [True], verdict  # made, once, and it held


@pytest.mark.timeout(300)
@pytest.mark.parametrize("entry, done", [("ddp_mesh", "localized after wrapping"),
                                         ("transform_ddp", "localized after wrapping"),
                                         ("replicate", "after training")])
def test_torch_2_13s_ddp_entry_points_localize_what_they_are_told_to_ignore(tpdp_pools, entry, done):
    """DDP's transform localizes every DTensor parameter, its ignore list included;
    replicate() leaves them at wrapping, and its forward hook localizes them after the first
    forward (docs/known-divergences.md, fault 11)."""
    failed = [c for c in made(verdict_one_device(tpdp_pools.get(4), "torch", case(entry))) if not c.ok]
    assert failed and "w1.weight" in failed[0].detail and done in failed[0].detail, failed


def test_no_ignore_list_no_check(tpdp_pools):
    assert not made(verdict_one_device(tpdp_pools.get(4), "torch", case("fully_shard", ignored="")))
