"""The structural properties on real ranks: the reference passes them, torch's divergences
are found and shrunk, and a mutant of every clause of the module transform is caught."""

import dataclasses
import traceback

import pytest

from tpdp_verify.properties import ignored_params_untouched, paths_resolve, registry_preserved

import mutants
from helpers import divergences, the_one

STRUCTURAL = [paths_resolve, registry_preserved, ignored_params_untouched]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("prop", STRUCTURAL, ids=lambda p: p.name)
def test_reference_satisfies(tpdp_pools, tpdp_profile, prop, world_size):
    stats = prop.run(tpdp_pools.get(world_size), "reference", tpdp_profile)
    assert stats.passed >= tpdp_profile.max_examples


def _torch_failure(prop, pool, profile, text):
    """The message of torch's divergence that says ``text``, and its shrunk case: hypothesis
    shrinks each signature apart and raises a group when it finds several."""
    return the_one(*divergences(prop, pool, "torch", profile), text)


def test_torch_moves_a_replaced_parameter_to_the_end(tpdp_pool, tpdp_profile):
    message, drawn = _torch_failure(paths_resolve, tpdp_pool, tpdp_profile,
                                    "  replacement keeps the registration order (rank")
    assert len(drawn["case"].root.params) + len(drawn["case"].root.children) == 2


def test_torch_empties_the_registry_after_a_forward(tpdp_pool, tpdp_profile):
    message, drawn = _torch_failure(registry_preserved, tpdp_pool, tpdp_profile,
                                    "  parameter names (ranks 0, 1): after forward 1")
    assert "expected ['l'], got []" in message and len(drawn["modes"]) == 1


def test_torch_reorders_parameters_when_localizing_with_ignored_ones(tpdp_pool, tpdp_profile):
    _torch_failure(ignored_params_untouched, tpdp_pool, tpdp_profile,
                   "  names and their order survive localize (rank")


@pytest.mark.parametrize("mutant", mutants.MODULE_MUTANTS, ids=lambda m: m.__name__)
def test_every_module_mutant_is_caught(tpdp_pools, tpdp_profile, mutant):
    """Found by the first of the structural properties that checks the clause the mutant
    breaks; unshrunk where the first failure found already says so."""
    profile = dataclasses.replace(tpdp_profile, shrink=mutant.shown_shrunk)
    messages = []
    for prop in STRUCTURAL:
        try:
            prop.run(tpdp_pools.get(4), f"mutants.{mutant.__name__}", profile)
        except Exception as exc:  # one failure, or hypothesis's group of distinct ones
            messages.append("".join(traceback.format_exception(exc)))
            if f"  {mutant.caught_by} (rank" in messages[-1]:
                return
    pytest.fail(f"no property says {mutant.caught_by!r}: {messages}")
