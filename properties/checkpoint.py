"""Checkpoints: a TP+DP model's state_dict looks like the unsharded model's, and a saved
model and optimizer load into a fresh TP+DP model that then steps exactly like the
uninterrupted one, by every route a user takes (tpdp_verify.ranks.checkpoint.ROUTES).
The cases and where each property searches are here; running and judging a checkpoint
is the oracle's (tpdp_verify.oracles.checkpoints).
"""

from __future__ import annotations

from hypothesis import assume
from hypothesis import strategies as st

from tpdp_verify.cases.training import ENTRIES, TrainCase
from tpdp_verify import hypothesis_internals
from tpdp_verify.errors import UsageError
from tpdp_verify.oracles.checkpoints import verdict_resume, verdict_state_dict
from tpdp_verify.properties.exclusions import UNTRAINABLE
from tpdp_verify.properties.training import every_entry, every_model, fused_through_every_entry, train_cases
from tpdp_verify.ranks.checkpoint import ROUTES
from tpdp_verify.runner.property import tpdp_property, worth_explaining

# Where a correct transform must checkpoint exactly: the DP entry points that carry TP
# as documented (as properties.training.SOUND_CHECKPOINTS), by the routes that keep the tp dimension
# of every value. The rest departs whatever the transform, with the reference (completed
# by a load hook, tests/test_checkpoint.py) as with torch's, and checkpoints exactly
# without TP through the same entry point (docs/properties.md, "Checkpoints"):
# replicate localizes in its own forward hooks, so after a forward its state_dict()
# holds local shards; get_optimizer_state_dict hands DDP's and FSDP1's optimizer state
# out as plain tensors, which DCP takes for replicas: every tp rank loads one rank's.
# And torch.distributed.checkpoint's own, without TP too: a parameter that never gets a
# gradient (the `unused` model) has no optimizer state to save, but the fresh optimizer's
# template has one: dcp.load raises "Missing key in checkpoint state_dict", and
# set_optimizer_state_dict "Missing optimizer state for parameter 'spare.w1.weight'".
# An optimizer built before wrapping or after a first forward, and DDP's static graph,
# are training's unsound timings and options (properties.training.SOUND_TRAINING): the
# entry_points_ properties checkpoint them.
SOUND_CHECKPOINTS = dict(entries=("ddp_mesh", "transform_ddp", "fully_shard", "fsdp1"), built=("after_wrap",))
UNSOUND_PAIRS = {("ddp_mesh", "dcp"), ("transform_ddp", "dcp"), ("fsdp1", "get_set"), ("fsdp1", "dcp")}
UNSOUND_MODEL_ROUTES = {("unused", "dcp"), ("unused", "get_set")}


def sound(entry: str, route: str | None = None, model: str = "", case: TrainCase | None = None) -> bool:
    """Whether a checkpoint by ``route`` through ``entry`` of ``model`` (and, given, of the
    case's optimizer timing and DDP options) is in the sound space."""
    timing = case is None or (case.built in SOUND_CHECKPOINTS["built"] and not case.ddp.static_graph)
    return (entry in SOUND_CHECKPOINTS["entries"] and (entry, route) not in UNSOUND_PAIRS
            and (model, route) not in UNSOUND_MODEL_ROUTES and timing)


def _within(space: bool, case: TrainCase, route: str) -> None:
    """assume() while hypothesis draws; outside it (a replay, a baseline's rerun), where
    assume is deprecated, a case and route outside the property's space are a usage error."""
    if hypothesis_internals.in_test():
        assume(space)
    elif not space:
        raise UsageError(f"route {route!r} with {case.entry} and model {case.model!r} is outside this "
                         "property's space (properties/checkpoint.py: sound)")


def trainable(case: TrainCase) -> bool:
    """Cases whose training itself works, so that there is something to checkpoint: not
    DDP's static graph with more than one microbatch a step, nor FSDP1 with TP on one dp
    rank or with more than one microbatch; those are training's findings, not checkpoints'
    (the exclusions UNTRAINABLE, properties/exclusions.py)."""
    return not any(x.test(case) for x in UNTRAINABLE)


def checkpoint_cases(world_size: int, entries: tuple[str, ...] = SOUND_CHECKPOINTS["entries"], **narrower
                     ) -> st.SearchStrategy[TrainCase]:
    """Training cases for checkpoints: 1-3 steps, the entry points' first options and no
    training habits (the exclusion checkpoint_options_and_habits), cases that train (``trainable``)."""
    return train_cases(world_size, entries=entries, options=False, **narrower).filter(trainable)


def sound_cases(world_size: int) -> st.SearchStrategy[TrainCase]:
    return checkpoint_cases(world_size, built=SOUND_CHECKPOINTS["built"], static_graph=(False,))


def all_cases(world_size: int) -> st.SearchStrategy[TrainCase]:
    return checkpoint_cases(world_size, ENTRIES)


def _covering(in_space, entries: tuple[str, ...], fused_entries: tuple[str, ...] = ()):
    """every_model's cases, each with the first route that puts it in the property's space;
    then the MLP's simplest case through every entry point, by every route in the space. A
    route is drawn apart from the case, so an entry point with one route in the space
    (FSDP1's state_dict) gets a few of 40 drawn cases, or none: every pair is met here.
    Last, the fused model through ``fused_entries`` by every route in the space (fused_over_dp)."""

    def cover(strategies: dict) -> list[dict]:
        models = [{**c, "route": route} for c in every_model(strategies)
                  for route in [next((r for r in ROUTES if in_space(c["case"], r)), None)] if route]
        met = {(repr(c["case"]), c["route"]) for c in models}
        return models + [{"case": c, "route": r} for c in every_entry(strategies, entries) for r in ROUTES
                         if in_space(c, r) and (repr(c), r) not in met] + [
            {"case": c, "route": r} for c in fused_over_dp(strategies, fused_entries) for r in ROUTES if in_space(c, r)]

    return cover


def fused_over_dp(strategies: dict, entries: tuple[str, ...]) -> list[TrainCase]:
    """The zoo's fused model (a weight sharded per part over tp) through ``entries`` the
    space reaches, on a mesh of 2 dp ranks (world sizes of 4 and more: training's fused_through_every_entry),
    whose checkpoints hold its per-part shards: under fully_shard its state_dict reads
    them out of place (fault 36) and DCP refuses to save them (fault 35). Not drawn (the
    zoo's COVER_ONLY)."""
    return [c for c in fused_through_every_entry(every_entry(strategies, entries)) if c.dp > 1]


def _state_dicts(entries: tuple[str, ...]):
    """every_model's cases, then the fused model's through ``entries`` (fused_over_dp)."""
    return lambda strategies: every_model(strategies) + [{"case": c} for c in fused_over_dp(strategies, entries)]


def sound_state_dict_cases(world_size: int) -> st.SearchStrategy[TrainCase]:
    return checkpoint_cases(world_size, built=SOUND_CHECKPOINTS["built"], static_graph=(False,))


def unsound_state_dict_cases(world_size: int) -> st.SearchStrategy[TrainCase]:
    return all_cases(world_size).filter(lambda c: not sound(c.entry, case=c))


@tpdp_property(min_world_size=2, cover=_state_dicts(("ddp_mesh", "fsdp1", "fully_shard")), case=sound_state_dict_cases)
def state_dict_like_unsharded(pool, impl: str, case: TrainCase, explain=worth_explaining) -> None:
    """state_dict() before and after training has the unsharded model's keys, order, global shapes and values."""
    verdict_state_dict(pool, impl, case, explain).raise_if_failed()


@tpdp_property(min_world_size=2, cover=every_model, case=unsound_state_dict_cases)
def entry_points_state_dict_like_unsharded(pool, impl: str, case: TrainCase, explain=worth_explaining) -> None:
    """The same through replicate, whose state_dict departs whatever the transform."""
    verdict_state_dict(pool, impl, case, explain).raise_if_failed()


@tpdp_property(min_world_size=2, case=sound_cases, route=st.sampled_from(ROUTES),
               cover=_covering(lambda c, r: sound(c.entry, r, c.model, c), SOUND_CHECKPOINTS["entries"],
                               ("fully_shard",)))
def checkpoint_resumes(pool, impl: str, case: TrainCase, route: str, explain=worth_explaining) -> None:
    """Saved after training and loaded into a fresh TP+DP model, model and optimizer are bit-exact, and so is the next step."""
    _within(sound(case.entry, route, case.model, case), case, route)
    verdict_resume(pool, impl, case, route, explain, dp_own_passes=True).raise_if_failed()


@tpdp_property(min_world_size=2, case=all_cases, route=st.sampled_from(ROUTES),
               cover=_covering(lambda c, r: not sound(c.entry, r, c.model, c), ENTRIES))
def entry_points_checkpoint_resume(pool, impl: str, case: TrainCase, route: str, explain=worth_explaining) -> None:
    """The same where an entry point or route departs whatever the transform: replicate, DCP of DDP's and FSDP1's optimizer state."""
    _within(not sound(case.entry, route, case.model, case), case, route)
    verdict_resume(pool, impl, case, route, explain).raise_if_failed()
