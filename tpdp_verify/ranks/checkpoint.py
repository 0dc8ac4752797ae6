"""Checkpointing a TP+DP model, inside a rank: save after training, load into a fresh model.

A rank builds the case's TP+DP model (the same steps as tpdp_verify.ranks.tp_dp.observe),
trains it, reads its ``state_dict()``, saves model and optimizer by one route, builds a
second model of the same case from another seed (so that a load that moves nothing shows),
loads the checkpoint into it, and lets both take the next step on the same batch. What
each saw comes back as a ``Seen``: values as the rank holds them (a whole tensor or its
Piece, put together in the parent) and values only this rank can compare with its own
(outputs of its rows, FSDP1's flat-sharded optimizer state).

Functions sent to ranks are module level, as RankPool.run needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import traceback
from dataclasses import dataclass, field

import torch

from tpdp_verify import signature
from tpdp_verify.cases.training import TrainCase
from tpdp_verify.ranks.loop import (
    Run,
    batches,
    build_optimizer,
    fixture,
    held_params,
    make_optimizer,
    maybe_loss_parallel,
    named,
    optimizer_state,
    snapshot,
    train,
    user_named,
    whole,
)
from tpdp_verify.ranks.observation import Observation
from tpdp_verify.ranks.rank import caught
from tpdp_verify.ranks.tp_dp import parter, run_of, tp_model

# How a checkpoint travels from the trained model to the fresh one:
#   state_dict: model.state_dict() / load_state_dict(), optimizer.state_dict() /
#               load_state_dict(), through torch.save and torch.load (in memory);
#   get_set:    torch.distributed.checkpoint.state_dict's get_model_state_dict /
#               get_optimizer_state_dict, torch.save / torch.load, then set_*;
#   dcp:        the same state dicts through torch.distributed.checkpoint.save / load
#               into a directory the ranks share, then set_* (torch's documented recipe).
ROUTES = ("state_dict", "get_set", "dcp")


@dataclass
class Seen(Observation):
    """What one rank saw of a checkpoint."""
    # "before training" / "after training" -> the state_dict's entries: (key, type, shape)
    entries: dict = field(default_factory=dict)
    # label -> name -> a whole tensor or the rank's Piece of a global one (merged in the parent)
    values: dict = field(default_factory=dict)
    # label -> name -> a tensor this rank compares with its own other label (not merged)
    local: dict = field(default_factory=dict)
    parameters: int = 0  # named_parameters(remove_duplicate=False) of the TP'd model


def _stateful(wrapped) -> torch.nn.Module:
    """The module whose state_dict() a user saves: DDP's inner module, else the model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return wrapped.inner if isinstance(wrapped.model, DDP) else wrapped.model


def _prepare(case: TrainCase, impl, mesh, tp: bool, seed: int):
    """The case's model from ``seed``, TP'd on mesh["tp"] (unless ``tp`` is False) and wrapped
    by its DP entry point: (run, wrapped, optimizer built before wrapping or None)."""
    from tpdp_verify.ranks.entries import WRAP

    model, before, early = tp_model(case, mesh, tp, seed)
    wrapped = WRAP[case.entry](model, case, mesh, impl)
    return run_of(case, wrapped, mesh, before), wrapped, early


def _entries(state_dict: dict) -> list[tuple[str, str, tuple]]:
    return [(k, type(v).__name__, tuple(v.shape) if isinstance(v, torch.Tensor) else ())
            for k, v in state_dict.items()]


def _state_dict_values(state_dict: dict) -> dict:
    """Each entry as this rank holds it: a DTensor as its Piece, any other tensor whole
    (a local shard standing for a DTensor is not put back: it is what the user got)."""
    part = parter({})
    return {k: part(k, v.detach().clone()) for k, v in state_dict.items() if isinstance(v, torch.Tensor)}


def _model_values(run: Run) -> dict:
    """Every parameter (whole or its Piece) and buffer, read through the captured handles."""
    with held_params(run) as current:
        values = snapshot(run, current)
    # whole, as train() reads them: the SPMD form's buffers are DTensors on the whole mesh
    values.update({f"buffer {n}": whole(b.detach()).clone() for n, b in user_named(run.inner.named_buffers())})
    return values


def _optimizer_values(run: Run, optimizer) -> tuple[dict, dict]:
    """(state to merge, state to compare rank by rank). FSDP1 keeps each state tensor as
    this rank's part of a flat shard, which only this rank can compare."""
    params = named(run, optimizer)
    if run.state_unobserved:
        raw = {f"{n}: {k}": v.detach().clone() for n, p in params.items()
               for k, v in sorted(optimizer.state.get(p, {}).items()) if isinstance(v, torch.Tensor)}
        return {}, raw
    return optimizer_state(run, params, optimizer), {}


def _next_step(case: TrainCase, run: Run, optimizer, micro: list[dict]) -> dict:
    """One more step, as tpdp_verify.ranks.loop.train takes one: every microbatch's output
    and loss as this rank sees them."""
    fx, out = fixture(case), {}
    for m, b in enumerate(micro, 1):
        local = run.take(b)
        sync = contextlib.nullcontext() if m == len(micro) else run.no_sync()
        with sync, maybe_loss_parallel(run.loss_parallel):
            o = run.model(local["input"])
            loss = (local["weight"] * fx.per_sample_loss(o, local)).mean()
            loss.backward()
        out[f"output {m}"] = whole(o.detach()).clone()
        out[f"loss {m}"] = whole(loss.detach()).clone()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return out


def _save(route: str, wrapped, optimizer, directory: str) -> bytes | None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if route == "state_dict":
        saved = {"model": _stateful(wrapped).state_dict(), "optim": optimizer.state_dict()}
    else:
        saved = {"model": get_model_state_dict(wrapped.model),
                 "optim": get_optimizer_state_dict(wrapped.model, optimizer)}
    if route == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save(saved, checkpoint_id=directory)
        return None
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    return buffer.getvalue()


def _load(route: str, wrapped, optimizer, saved: bytes | None, directory: str) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    if route == "dcp":
        import torch.distributed.checkpoint as dcp

        loaded = {"model": get_model_state_dict(wrapped.model),
                  "optim": get_optimizer_state_dict(wrapped.model, optimizer)}
        dcp.load(loaded, checkpoint_id=directory)
    else:
        loaded = torch.load(io.BytesIO(saved), weights_only=False)
    if route == "state_dict":
        _stateful(wrapped).load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optim"])
    else:
        set_model_state_dict(wrapped.model, loaded["model"])
        set_optimizer_state_dict(wrapped.model, optimizer, loaded["optim"])


try:
    from torch.distributed.checkpoint.api import CheckpointException as _CheckpointException
except ImportError:  # pragma: no cover - every torch the project supports has it
    _CheckpointException = Exception


def _text(exc: BaseException) -> str:
    """One line for an exception; DCP's CheckpointException carries every rank's
    traceback: keep the header and each rank's last line."""
    text = "".join(traceback.format_exception_only(exc)).strip()
    if isinstance(exc, _CheckpointException):
        lines = text.splitlines()
        text = "; ".join([lines[0]] + [l for l in lines[1:] if l and not l[0].isspace() and not l.startswith("Traceback")])
    return text


def observe_checkpoint(case: TrainCase, impl_name: str, route: str | None, directory: str = "",
                       tp: bool = True) -> Seen:
    """On every rank: train the case, read its state_dict, and (``route`` given) save by
    that route, load into a fresh TP+DP model of the case, and take the next step with both.

    With ``tp=False`` the unsharded model goes through the same entry point (plain DP).
    ``directory`` is where the dcp route writes; every rank must get the same, empty one.
    """
    from tpdp_verify.impls.select import installed, load
    from tpdp_verify.ranks.rank import device_mesh

    impl, seen = load(impl_name), Seen()
    mesh = device_mesh(case.mesh_shape, case.mesh_dims)
    stage = "wrapping"
    try:
        with installed(impl):
            run, wrapped, early = _prepare(case, impl, mesh, tp, case.seed)
            seen.parameters = len(run.before_wrap)
            stage = "state_dict() before training"
            state_dict = _stateful(wrapped).state_dict()
            seen.entries["before training"] = _entries(state_dict)
            seen.values["state_dict before training"] = _state_dict_values(state_dict)
            optimizers = []

            def new_optimizer():
                optimizers.append(early or make_optimizer(case, run.model.parameters()))
                return optimizers[-1]

            stage = "training"
            trace = train(case, run, new_optimizer)
            if trace.error:
                seen.raised = trace.raised
                raise RuntimeError(trace.error)
            optimizer = optimizers[-1]
            stage = "state_dict() after training"
            state_dict = _stateful(wrapped).state_dict()
            seen.entries["after training"] = _entries(state_dict)
            seen.values["state_dict after training"] = _state_dict_values(state_dict)
            seen.values["trained model"] = _model_values(run)
            del state_dict
            if route is None:
                return seen
            seen.values["saved optimizer"], seen.local["saved optimizer"] = _optimizer_values(run, optimizer)
            stage = f"saving ({route})"
            saved = _save(route, wrapped, optimizer, directory)
            stage = "building the fresh model"
            fresh, fresh_wrapped, fresh_early = _prepare(case, impl, mesh, tp, case.seed + 1)
            data = batches(dataclasses.replace(case, steps=case.steps + 1))
            fresh_optimizer = build_optimizer(case, fresh, data, lambda: fresh_early or make_optimizer(
                case, fresh.model.parameters()))
            seen.values["fresh model"] = _model_values(fresh)
            stage = f"loading ({route})"
            _load(route, fresh_wrapped, fresh_optimizer, saved, directory)
            seen.values["loaded model"] = _model_values(fresh)
            seen.values["loaded optimizer"], seen.local["loaded optimizer"] = _optimizer_values(fresh, fresh_optimizer)
            stage = "the uninterrupted model's next step"
            seen.local["uninterrupted step"] = _next_step(case, run, optimizer, data[-1])
            seen.values["uninterrupted model after the step"] = _model_values(run)
            seen.values["uninterrupted optimizer after the step"], seen.local["uninterrupted optimizer after the step"] = \
                _optimizer_values(run, optimizer)
            stage = "the resumed model's next step"
            seen.local["resumed step"] = _next_step(case, fresh, fresh_optimizer, data[-1])
            seen.values["resumed model after the step"] = _model_values(fresh)
            seen.values["resumed optimizer after the step"], seen.local["resumed optimizer after the step"] = \
                _optimizer_values(fresh, fresh_optimizer)
    # DCP raises CheckpointException, a BaseException: a finding too
    except (Exception, _CheckpointException) as exc:  # a stage that raises is a finding, not a crash of ours
        seen.error = f"{stage}: {_text(exc)}{signature.innermost(exc)}"
        seen.raised = seen.raised or signature.raised(exc)
        caught(seen.error, seen.raised)
    return seen
