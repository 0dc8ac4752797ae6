"""Verify a user's TP plan: their model, plan, data and loss through the suite's oracles.

``verify_plan`` carries the user's callables in a ``TrainCase`` (its ``user`` field), checks
every input it can before training (a mistake gets one line saying what to do, as a
``UsageError``), trains the case on the ranks and compares it with the unsharded model on
one device and with the same DP entry point without TP. The result is a ``Report``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import pickle
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from tpdp_verify import signature
from tpdp_verify.cases.training import DP, TRAIN_DTYPES, DDPOptions, TrainCase
from tpdp_verify.errors import PoolError, RankFailed, UsageError
from tpdp_verify.styles import resolve


def name_of(fn) -> str:
    """``module:qualname``, how the CLI and the replay line name a function; a script's
    functions by the script's name, the module its directory imports."""
    module = getattr(fn, "__module__", "?")
    if module in ("__main__", "__mp_main__"):
        module = Path(getattr(sys.modules[module], "__file__", module)).stem
    return f"{module}:{getattr(fn, '__qualname__', type(fn).__name__)}"


def mean_square(out, batch: dict) -> torch.Tensor:
    """The default per-sample loss: the mean square of each sample's output (of a pytree
    output, its first tensor leaf with the batch's rows: a ModelOutput's logits)."""
    import torch.utils._pytree as pytree
    from torch.distributed.tensor import DTensor

    rows = len(next(iter(batch.values())))
    out = next((t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() and len(t) == rows), out)
    out = out.full_tensor() if isinstance(out, DTensor) else out
    return out.reshape(len(out), -1).pow(2).mean(1)


def as_batch(value) -> dict:
    """input_fn's result as the training loop takes it: a dict with the model's "input", or
    with the keyword arguments of its forward (and any targets)."""
    if isinstance(value, torch.Tensor):
        return {"input": value}
    if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        return value
    raise UsageError(f"input_fn returned {type(value).__name__}: return the model's input tensor, or a dict of "
                     "tensors: the input under 'input' or the forward's keyword arguments by name, and any targets")


@dataclass(frozen=True)
class UserModel:
    """A user's model, plan, data and loss, as a case carries them to the ranks (by name)."""

    model_fn: Callable[[], nn.Module]
    plan: object  # a tuple of (key, style) pairs, a callable tp_mesh -> dict, or None
    input_fn: Callable[[int, torch.Generator], object]  # (n samples, generator) -> batch
    loss_fn: Callable | None = None  # (output, batch) -> one loss per sample
    optimizer_fn: Callable | None = None  # parameters -> optimizer
    loss_parallel: bool = False
    parallelize_fn: Callable | None = None  # (model, (dp, tp) mesh) -> the TP'd model, in place of plan

    def fixture(self):
        from hypothesis import strategies as st

        from tpdp_verify.fixtures.zoo import Fixture, Size

        return Fixture(name=name_of(self.model_fn), build=lambda size: self.model_fn(),
                       plan=lambda size: self.plan if callable(self.plan) else dict(self.plan or ()),
                       batch=lambda gen, n, size: as_batch(self.input_fn(n, gen)),
                       per_sample_loss=self.loss_fn or mean_square, sizes=lambda tp: st.just(Size()),
                       loss_parallel=self.loss_parallel, parallelize=self.parallelize_fn)


# ------------------------------------------------------------------ checks before any rank


def _sendable(user: UserModel) -> None:
    for field in ("model_fn", "plan", "parallelize_fn", "input_fn", "loss_fn", "optimizer_fn"):
        try:
            pickle.dumps(getattr(user, field))
        except Exception as exc:
            raise UsageError(f"{field} cannot be sent to the ranks ({type(exc).__name__}: {exc}); "
                             "define it at module level, not as a lambda or inside a function") from None


def _call(what: str, fn, *args):
    try:
        return fn(*args)
    except UsageError:
        raise
    except Exception as exc:
        raise UsageError(f"{what} raised {type(exc).__name__}: {exc}") from None


def check_inputs(case: TrainCase) -> TrainCase:
    """Everything about the user's callables that the parent can check alone; the case
    with its plan as parallelize_module takes it (transformers' style strings, a model's own
    plan, keys under the base model's prefix: tpdp_verify.styles)."""
    from tpdp_verify import styles
    from tpdp_verify.ranks.loop import forward, model_keys, output_leaves

    user, n = case.user, case.global_batch
    _sendable(user)
    torch.manual_seed(case.seed)
    model = _call("model_fn()", user.model_fn)
    if not isinstance(model, nn.Module):
        raise UsageError(f"model_fn returned a {type(model).__name__}, not an nn.Module")
    if user.plan is not None and not callable(user.plan):  # a typo costs seconds, not a pool's start
        plan = styles.torch_plan(model, user.plan if user.plan == styles.AUTO else dict(user.plan))
        problems = plan_problems(model, plan, case.tp)
        if problems:
            raise UsageError(problems[0])
        case = dataclasses.replace(case, user=dataclasses.replace(user, plan=tuple(plan.items())))
    batches = [as_batch(_call(f"input_fn({n}, generator)", user.input_fn, n, torch.Generator().manual_seed(case.seed)))
               for _ in range(2)]
    for key, value in batches[0].items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or len(value) != n:
            shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise UsageError(f"input_fn({n}, generator) returned {key!r} of shape {shape}: dim 0 must hold "
                             f"the {n} samples asked for, {case.local_batch} for each of the {case.dp} dp ranks")
    if any(not torch.equal(batches[0][k], batches[1][k]) for k in batches[0]):
        raise UsageError("input_fn returned different batches for the same generator: draw every random "
                         "value from the generator it is given (torch.randn(..., generator=generator))")
    batch = {k: v.to(case.torch_dtype) if v.is_floating_point() else v for k, v in batches[0].items()}
    if "input" not in batch and not model_keys(model, batch):
        raise UsageError(f"input_fn's dict has no 'input' and none of its keys ({', '.join(batch)}) is an argument of "
                         f"{type(model).__name__}.forward: put the input under 'input', or name the forward's arguments")
    out = _call("the model's forward on input_fn's input", forward, model, model, batch)
    leaves, unread = output_leaves(out, n)
    if not leaves:
        raise UsageError(f"the model's output has no tensor with the batch's {n} samples in dim 0 to compare"
                         + (f" (it holds {'; '.join(unread)})" if unread else "")
                         + ": return the outputs per sample, batch first")
    loss = _call("loss_fn(output, batch)", user.loss_fn or mean_square, out, batch)
    if not isinstance(loss, torch.Tensor) or loss.shape not in ((n,), ()):
        got = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise UsageError(f"loss_fn returned {got} for a batch of {n}: return one loss per sample "
                         f"(shape [{n}]), which tpdp-verify weights at random, or the batch's mean loss (a scalar)")
    return case


# ------------------------------------------------------------------ checks on the ranks

# Styles that shard a module's parameters, the module types they know, and which dim of
# the weight each shards (Linear's weight is [out, in]; Embedding's [num, dim]).
def _sharding_styles():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {ColwiseParallel: {nn.Linear: 0, nn.Embedding: 1}, RowwiseParallel: {nn.Linear: 1, nn.Embedding: 0}}


def plan_problems(model: nn.Module, plan: dict, tp: int) -> list[str]:
    """What is wrong with a plan for this model, one line each, before torch applies it."""
    modules = dict(model.named_modules())
    styles, problems = _sharding_styles(), []
    for key, style in plan.items():
        paths = resolve(model, key)
        if not paths:
            near = difflib.get_close_matches(key, [m for m in modules if m], n=3, cutoff=0.5)
            problems.append(f"plan key {key!r} matches no module of the model"
                            + (f"; did you mean {' or '.join(map(repr, near))}?" if near else
                               "; keys are dotted module paths as named_modules() gives them"))
            continue
        kinds = next((v for k, v in styles.items() if isinstance(style, k)), None)
        for path in paths:
            module = modules[path]
            dim = next((d for t, d in (kinds or {}).items() if isinstance(module, t)), None)
            if kinds and dim is None:
                problems.append(f"plan key {key!r} gives {type(style).__name__} to {path!r}, a "
                                f"{type(module).__name__}; it shards only {' and '.join(t.__name__ for t in kinds)}")
            elif dim is not None and module.weight.shape[dim] < tp:
                problems.append(f"plan key {key!r}: {type(style).__name__} shards dim {dim} of {path}.weight "
                                f"(size {module.weight.shape[dim]}) over {tp} tp ranks, so some rank would hold "
                                f"none of it; widen it to at least {tp} or leave {path!r} out of the plan")
            elif dim == 0 and isinstance(module, nn.Linear):
                problems += _split_heads(key, path, module, modules.get(path.rpartition(".")[0]), tp)
    return problems


def _split_heads(key: str, path: str, linear: nn.Linear, owner: nn.Module | None, tp: int) -> list[str]:
    """A column-sharded projection of an attention module (one with a ``head_dim``, or a
    config holding it, as transformers' have) must give each rank whole heads: its forward
    views the rank's columns as (heads, head_dim) and fails there otherwise."""
    head_dim = next((d for o in (owner, getattr(owner, "config", None))
                     if isinstance(d := getattr(o, "head_dim", None), int) and d > 0), None)
    width = linear.out_features
    if head_dim is None or width % head_dim:
        return []
    chunk = -(-width // tp)  # torch.chunk's split, as DTensor's Shard makes it
    shards = [max(0, min(chunk, width - r * chunk)) for r in range(tp)]
    if all(n % head_dim == 0 for n in shards):
        return []
    return [f"plan key {key!r}: ColwiseParallel splits the {width // head_dim} heads of {path} (head_dim "
            f"{head_dim}) over {tp} tp ranks as {shards} columns, so some rank would hold part of a head; "
            f"use a tp that divides {width // head_dim}, or leave {path!r} out of the plan"]


def _checksums(model: nn.Module) -> dict[str, tuple[float, float]]:
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        flat = t.detach().double().flatten()
        out[name] = (flat.sum().item(), (flat * torch.arange(1, len(flat) + 1, dtype=torch.float64)).sum().item())
    return out


def preflight(case: TrainCase) -> tuple[list[str], dict]:
    """On every rank: the plan's problems for the model this rank builds, and its checksums.

    parallelize_module skips a plan key it cannot resolve with a warning and trains a half
    parallelized model; here its warnings are problems too.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from tpdp_verify.ranks.loop import build, fixture
    from tpdp_verify.ranks.pool import device_mesh
    from tpdp_verify.ranks.tp_dp import MESH_DIMS, plan_for

    mesh = device_mesh(case.mesh_shape, MESH_DIMS)
    model = build(case)
    sums = _checksums(model)
    if case.user.parallelize_fn is not None:
        return _parallelize_problems(case.user.parallelize_fn, model, mesh, case.entry == "own"), sums
    try:
        plan = plan_for(fixture(case), case, mesh["tp"])
    except Exception as exc:
        return [f"the plan function raised {type(exc).__name__}: {exc}"], sums
    if not isinstance(plan, dict):
        return [f"the plan is a {type(plan).__name__}; give a dict of module path -> ParallelStyle "
                "(or a function of the tp mesh returning one)"], sums
    problems = plan_problems(model, plan, case.tp)
    if problems:
        return problems, sums
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            parallelize_module(model, mesh["tp"], plan)
        except Exception as exc:
            return [f"parallelize_module raised {type(exc).__name__}: {str(exc).splitlines()[0]}"], sums
    return [f"parallelize_module: {w.message}" for w in caught if "could not be resolved" in str(w.message)], sums


def _parallelize_problems(parallelize_fn, model: nn.Module, mesh, own_dp: bool) -> list[str]:
    """What is wrong with what a user's parallelize function does to the model; a plan key
    it cannot resolve is a problem too (parallelize_module only warns)."""
    from tpdp_verify.ranks.entries import own_entry

    name = name_of(parallelize_fn)
    shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = parallelize_fn(model, mesh)
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            return [f"parallelize_fn {name} raised {type(exc).__name__}: {first}"]
    if out is not None and not isinstance(out, nn.Module):
        return [f"parallelize_fn {name} returned a {type(out).__name__}: return the model (or None)"]
    unresolved = [f"parallelize_fn {name}: {w.message}" for w in caught if "could not be resolved" in str(w.message)]
    if unresolved:
        return unresolved
    out = model if out is None else out
    entry = own_entry(out)
    if own_dp and entry is None:
        return [f"parallelize_fn {name} applied no DP, and dp='own' says it does: wrap the model in DDP, "
                "replicate, fully_shard or FSDP on mesh['dp'] and return the wrapper, or pass dp='ddp' (or "
                "another) for tpdp-verify to wrap it"]
    if not own_dp and entry is not None:
        return [f"parallelize_fn {name} wrapped the model in DP ({entry}) itself: pass dp='own', so that "
                "tpdp-verify drives your wrapper instead of wrapping it again"]
    wiring = _wiring_problems(out, mesh, name, entry)
    if wiring:
        return wiring
    if not tp_sharded(out, shapes):
        return [f"parallelize_fn {name} left every parameter a plain tensor: apply TP to the tp dimension of "
                "the mesh it is given (parallelize_module(model, mesh['tp'], plan))"]
    return []


def _wiring_problems(model: nn.Module, mesh, name: str, entry: str | None) -> list[str]:
    """Meshes a parallelize function can get crossed, which torch accepts silently: TP over
    the dp dimension, and DP reducing over another group than mesh['dp']'s (its replicas
    would average different TP shards)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if entry not in ("fully_shard", "fsdp1"):  # FSDP's own DTensors live on the dp mesh by design
        inner = model.module if entry in ("ddp_mesh", "transform_ddp") else model
        for pname, p in inner.named_parameters():
            spec = p._spec if isinstance(p, DTensor) else getattr(p, "_st_info", None)
            if spec is not None and "tp" not in (spec.mesh.mesh_dim_names or ()):
                return [f"parallelize_fn {name} applies TP to {pname} over mesh {spec.mesh.mesh_dim_names}, not "
                        "mesh['tp']: TP shards over the tp dimension, DP replicates over the dp one"]
    group = _dp_group(model, entry)
    if group is None:
        return []
    ranks, want = dist.get_process_group_ranks(group), dist.get_process_group_ranks(mesh["dp"].get_group())
    if ranks != want:
        named = next((f" (mesh[{d!r}]'s)" for d in mesh.mesh_dim_names
                      if dist.get_process_group_ranks(mesh[d].get_group()) == ranks), "")
        return [f"parallelize_fn {name} wraps DP ({entry}) over ranks {ranks}{named}, not mesh['dp']'s {want} "
                "(on this rank): its replicas would average different TP shards; give the wrapper mesh['dp']"]
    return []


def _dp_group(model: nn.Module, entry: str | None):
    """The process group a user's DP wrapper reduces over, where it says (None where not)."""
    from torch.distributed._composable.replicate import replicate

    if entry in ("ddp_mesh", "transform_ddp", "fsdp1"):
        return model.process_group
    if entry == "replicate":
        kwargs = getattr(replicate.state(model), "_init_kwargs", {})
        mesh = kwargs.get("device_mesh")
        return mesh.get_group() if mesh is not None else kwargs.get("process_group")
    return None


def tp_sharded(model: nn.Module, shapes: dict) -> list[str]:
    """The parameters TP holds apart: DTensors on a mesh with a tp dimension, and the local
    shards a DDP-style wrapper keeps in their place (of another shape than ``shapes`` gives,
    or carrying the transform's record of their DTensor)."""
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return [n for n, p in inner.named_parameters(remove_duplicate=False)
            if ("tp" in (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else
                hasattr(p, "_st_info") or p.shape != shapes.get(n, p.shape))]


def check_on_ranks(pool, case: TrainCase) -> tuple[int, str]:
    """Run ``preflight`` on every rank; raise the first problem; return how many plan keys
    were checked (or parameters a parallelize function sharded) and the DP entry point the
    ranks train under (the one a parallelize function applied itself, for dp="own").
    Weights must agree on every rank and with the parent's own build."""
    from tpdp_verify.ranks.loop import build

    replies = pool.run(preflight, case)
    for problems, _ in replies:
        if problems:
            raise UsageError(problems[0])
    mine = _checksums(build(case))
    for rank, (_, sums) in enumerate(replies):
        differ = [n for n in mine if sums.get(n) != mine[n]] or sorted(set(sums) - set(mine))
        if differ:
            raise UsageError(f"model_fn builds different weights on rank {rank} than in this process "
                             f"({differ[0]} differs): build them from torch's global RNG, which "
                             "tpdp-verify seeds before calling model_fn, or seed them alike everywhere")
    user = case.user
    if user.parallelize_fn is not None:
        return pool.run(_sharded, case)[0]
    return len(user.plan) if not callable(user.plan) else len(pool.run(_plan_keys, case)[0]), case.entry


def _plan_keys(case: TrainCase) -> list[str]:
    from tpdp_verify.ranks.loop import fixture
    from tpdp_verify.ranks.pool import device_mesh
    from tpdp_verify.ranks.tp_dp import MESH_DIMS, plan_for

    return list(plan_for(fixture(case), case, device_mesh(case.mesh_shape, MESH_DIMS)["tp"]))


def _sharded(case: TrainCase) -> tuple[int, str]:
    """On every rank: how many parameters the user's parallelize function holds apart by
    TP, and the DP entry point it trains under."""
    from tpdp_verify.ranks.entries import own_entry
    from tpdp_verify.ranks.loop import build, fixture
    from tpdp_verify.ranks.pool import device_mesh
    from tpdp_verify.ranks.tp_dp import MESH_DIMS, apply_tp

    model = build(case)
    shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
    model = apply_tp(fixture(case), case, model, device_mesh(case.mesh_shape, MESH_DIMS))
    return len(tp_sharded(model, shapes)), own_entry(model) if case.entry == "own" else case.entry


# ------------------------------------------------------------------ the API


def make_case(model_fn, plan, *, mesh, input_fn, loss_fn, steps, optimizer_fn, dp, dtype, batch,
              accumulate, ddp_options, loss_parallel, seed, parallelize_fn=None) -> TrainCase:
    """The TrainCase of a verify_plan call, its arguments checked."""
    if not callable(model_fn) or not callable(input_fn):
        raise UsageError("model_fn and input_fn must be callables: model_fn() -> nn.Module, "
                         "input_fn(n, generator) -> the input of n samples")
    if (plan is None) == (parallelize_fn is None):
        raise UsageError("give a plan (module path -> ParallelStyle) or parallelize_fn(model, mesh), "
                         f"{'not both' if plan is not None else 'one of them'}")
    if dp == "own" and parallelize_fn is None:
        raise UsageError("dp='own' means your parallelize_fn wraps DP itself: give parallelize_fn(model, mesh), "
                         "or a dp for tpdp-verify to wrap the plan's model with")
    if parallelize_fn is not None and not callable(parallelize_fn):
        raise UsageError(f"parallelize_fn is a {type(parallelize_fn).__name__}; give a function "
                         "(model, mesh) -> model that applies your TP to mesh['tp']")
    if plan is not None and not (callable(plan) or isinstance(plan, dict) or plan == "auto"):
        raise UsageError(f"plan is a {type(plan).__name__}; give a dict as parallelize_module takes it "
                         "(module path -> ParallelStyle, or transformers' style string), a function "
                         "tp_mesh -> dict, or 'auto' for the model's own tp_plan")
    if (not isinstance(mesh, (tuple, list)) or len(mesh) != 2
            or not all(isinstance(d, int) and d >= 1 for d in mesh)):
        raise UsageError(f"mesh must be (dp, tp), two positive ints, not {mesh!r}")
    if dp not in DP:
        raise UsageError(f"dp must be one of {', '.join(DP)}, not {dp!r}")
    name = str(dtype).removeprefix("torch.")
    if name not in TRAIN_DTYPES:
        raise UsageError(f"dtype must be one of {', '.join(TRAIN_DTYPES)}, not {name}")
    if not isinstance(steps, int) or steps < 1 or not isinstance(accumulate, int) or accumulate < 1:
        raise UsageError(f"steps and accumulate must be positive ints, not {steps!r} and {accumulate!r}")
    batch = 2 * mesh[0] if batch is None else batch
    if not isinstance(batch, int) or batch < mesh[0] or batch % mesh[0]:
        raise UsageError(f"batch={batch!r} does not split over dp={mesh[0]} ranks: give a multiple of {mesh[0]}")
    try:  # a list (bucket_cap_mb_list) as a tuple: a case is hashable
        ddp = DDPOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in (ddp_options or {}).items()})
    except TypeError as exc:
        raise UsageError(f"ddp_options: {exc}; the keys are those of tpdp_verify.cases.training.DDPOptions") from None
    user = UserModel(model_fn, plan if plan is None or callable(plan) or plan == "auto" else tuple(plan.items()),
                     input_fn,
                     loss_fn, optimizer_fn, loss_parallel, parallelize_fn)
    return TrainCase(model=name_of(model_fn), mesh_shape=tuple(mesh), entry=DP[dp], ddp=ddp, steps=steps,
                     accumulate=accumulate, local_batch=batch // mesh[0], seed=seed, dtype=name, user=user)


def verify_plan(model_fn: Callable[[], nn.Module], plan=None, *, parallelize_fn: Callable | None = None,
                mesh: tuple[int, int] = (1, 2),
                input_fn: Callable[[int, torch.Generator], object], loss_fn: Callable | None = None,
                steps: int = 3, optimizer_fn: Callable | None = None, dp: str = "ddp",
                dtype: torch.dtype = torch.float32, batch: int | None = None, accumulate: int = 1,
                ddp_options: dict | None = None, loss_parallel: bool = False, seed: int = 0,
                impl: str = "torch", pool=None, backend: str = "auto", timeout: float = 120.0,
                replay: str | None = None, baseline: str | None = None, rank_output: str | None = None):
    """Train ``model_fn()`` under ``plan`` with TP on a (dp, tp) mesh and a DP entry point,
    and compare it with one device and with plain DP; return a ``Report``.

    ``model_fn()`` builds the unsharded model from torch's global RNG (seeded with ``seed``
    first, alike on every rank). ``plan`` is what ``parallelize_module`` takes: a dict of
    module path (fnmatch wildcards per atom) -> ParallelStyle, or a function of the tp
    mesh returning one. Or, in place of a plan, ``parallelize_fn(model, mesh)``: the user's
    own function that applies TP (and any fix-up, such as re-tying weights) to the model,
    given the whole (dp, tp) mesh as torchtitan's parallelize functions are; it returns
    the model. tpdp-verify still wraps DP per ``dp``, unless ``dp="own"``: then the function
    applies DP itself too (DDP, replicate, fully_shard or FSDP on ``mesh["dp"]``, returning
    the wrapper), tpdp-verify drives the wrapper it finds, and the plain-DP comparison is
    not made (the report says so). ``input_fn(n, generator)`` returns the input of ``n`` samples
    (dim 0), or a dict with it under "input" and any targets; draw from ``generator``.
    ``loss_fn(output, batch)`` returns one loss per sample (default: mean square); each is
    weighted by a random weight, which exposes DP averaging bugs that ``.sum()`` hides.
    ``optimizer_fn(params)`` builds the optimizer (default SGD, lr 0.1, momentum 0.9). ``dp``:
    ddp (``_pre_dp_module_transform`` then DDP on the dp group), ddp_mesh (DDP with the dp
    sub-mesh), replicate, fsdp2 (``fully_shard``), fsdp1, or own (above). Runs on ``pool`` if given (its
    world size must be dp * tp), else on a pool of its own. ``baseline`` (a file or a shipped
    name such as "torch-2.13.0"): departures that are faults it records for this DP entry
    point are labelled known, with their entry in docs/known-divergences.md, and the
    report passes (status KNOWN) when nothing else departs. ``rank_output``: a directory for
    the ranks' stdout and stderr (torch's warnings, C++ logs), else the terminal.

    Every callable must be importable by name (module level): the ranks are other processes.
    Raises ``UsageError`` (one line) on bad input, ``PoolError`` if the ranks would not
    start. Ranks that raise, hang or die in the user's code fail the report's "trains
    without an exception" check, with each rank's traceback or stack.
    """
    from tpdp_verify.judging.verdict import Verdict
    from tpdp_verify.oracles.verdicts import verdict_one_device, verdict_plain_ddp
    from tpdp_verify.ranks.pool import RankPool
    from tpdp_verify.report import Report

    case = make_case(model_fn, plan, mesh=mesh, input_fn=input_fn, loss_fn=loss_fn, steps=steps,
                     optimizer_fn=optimizer_fn, dp=dp, dtype=dtype, batch=batch, accumulate=accumulate,
                     ddp_options=ddp_options, loss_parallel=loss_parallel, seed=seed,
                     parallelize_fn=parallelize_fn)
    known = _known_faults(baseline, case.entry, tuple(mesh)) if baseline else {}
    case = check_inputs(case)
    world = case.dp * case.tp
    if pool is not None and pool.world_size != world:
        raise UsageError(f"mesh {tuple(mesh)} holds {world} ranks but the pool has {pool.world_size}; "
                         f"give a mesh whose product is {pool.world_size}, or a pool of {world}")
    owned = pool is None
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if owned and world > cpus:
        warnings.warn(f"mesh {tuple(mesh)} needs {world} ranks and this machine has {cpus} CPUs: the ranks "
                      "time-share them, so the run takes longer (the verdict is the same)", stacklevel=2)
    if owned:  # the ranks' fork server imports the user's modules (transformers, say) once, for all
        from tpdp_verify.ranks.pool import warm_up

        warm_up(tuple(dict.fromkeys(fn.__module__ for fn in (model_fn, input_fn, loss_fn, optimizer_fn, parallelize_fn)
                                    if fn is not None and fn.__module__ not in ("__main__", "__mp_main__"))))
    pool = RankPool(world, backend, timeout=timeout, output=rank_output) if owned else pool
    keys, entry = 0, case.entry
    try:
        keys, entry = check_on_ranks(pool, case)
        one = verdict_one_device(pool, impl, case)
        plain = Verdict(against="plain DDP") if case.entry == "own" else verdict_plain_ddp(pool, impl, case)
    except (PoolError, RankFailed) as exc:  # ranks that raised, hung or died in the user's code
        one, plain = _did_not_finish(exc), Verdict(against="plain DDP")
    finally:
        if owned:
            pool.close()
    if case.entry == "own":
        known = _known_faults(baseline, entry, tuple(mesh)) if baseline else {}
    detail = None if parallelize_fn is None else f"parallelize_fn made {keys} parameters DTensors" \
        if case.entry != "own" else f"parallelize_fn sharded {keys} parameters by TP and wrapped DP itself ({entry})"
    return Report.of(case, keys, one, plain, replay or _replay(case, impl, plan, baseline), detail,
                     baseline or "", known, OWN_DP if case.entry == "own" else "")


OWN_DP = "parallelize_fn wraps DP itself (dp='own'), so there is no run without TP to compare with"


# The suite's training properties whose known faults a user's run can show, per oracle.
_TRAINING = {"one device": ("trains_like_one_device", "entry_points_train_like_one_device"),
             "plain DDP": ("trains_like_plain_ddp",)}


def _known_faults(name: str, dp_entry: str, mesh: tuple[int, int]) -> dict:
    from tpdp_verify.runner import baseline

    _, entries = baseline.load(name)  # a bad name or file: one line, before any rank starts
    return {against: baseline.training_parts(entries, props, dp_entry, mesh) for against, props in _TRAINING.items()}


def _did_not_finish(exc: BaseException):
    """A run whose ranks raised (outside the training loop, which reports its own), hung or
    died: a verdict that it did not train, with every rank's traceback or stack; the
    harness failing (ranks that would not start) is raised as it is."""
    from tpdp_verify.judging.verdict import Verdict
    from tpdp_verify.ranks.observation import Check
    from tpdp_verify.runner.property import finding

    found = finding(exc)
    if found is None and not isinstance(exc, RankFailed):
        raise exc
    part = found.signature[0] if found is not None else signature.raised_from_text(next(iter(exc.tracebacks.values())))
    said = str(found) if found is not None else str(exc)  # a hang's: with every silent rank's stack
    return Verdict([Check("trains without an exception", False, f"{_headline(exc)}\n{said}", part)])


def _headline(exc: BaseException) -> str:
    """What happened, in the words of the first rank that raised, or the pool's for a hang or death."""
    from tpdp_verify.ranks.pool import CAUGHT_PART

    if not isinstance(exc, RankFailed):
        return str(exc).splitlines()[0]
    rank = min(exc.tracebacks)
    lines = [ln for ln in exc.tracebacks[rank].splitlines() if ln.strip()
             and not ln.startswith(CAUGHT_PART)] or [""]
    said = lines[0].removeprefix("(caught and returned) ") if "(caught and returned)" in lines[0] else lines[-1]
    waiting = f" (rank {', '.join(map(str, exc.stuck))} waited for it in a collective)" if exc.stuck else ""
    return f"rank {rank}: {said}{waiting}"


def _replay(case: TrainCase, impl: str, plan, baseline: str | None) -> str:
    """A script that makes the same call: it imports the user's functions (and plan) from
    their modules' files, wherever it is run from."""
    u = case.user
    named = {"model_fn": u.model_fn, "input_fn": u.input_fn, "loss_fn": u.loss_fn, "optimizer_fn": u.optimizer_fn,
             "parallelize_fn": u.parallelize_fn, "plan": plan if callable(plan) else None}
    imports = {fn.__module__: [] for fn in named.values() if fn is not None}
    for fn in named.values():
        if fn is not None:
            imports[fn.__module__].append(fn.__qualname__.split(".")[0])
    plan_name, written = None, []
    if plan == "auto":
        plan_name = "'auto'"
    elif plan is not None and not callable(plan):
        plan_name = _plan_name(plan, imports)
        if plan_name is None:  # no module-level name: written out from its styles' reprs
            plan_name, written = "PLAN", [
                "from torch.distributed.tensor import Replicate, Shard",
                "from torch.distributed.tensor.parallel import *  # noqa: F403", "",
                "# the plan, from its styles' reprs (torch writes a layout as a tuple): check it",
                f"PLAN = {{{', '.join(f'{k!r}: {v!r}' for k, v in plan.items())}}}"]
    args = [named["model_fn"].__qualname__]
    if plan is not None:
        args.append(named["plan"].__qualname__ if callable(plan) else plan_name)
    args += [f"{k}={v.__qualname__}" for k, v in named.items() if v is not None and k not in ("model_fn", "plan")]
    dp = next(k for k, v in DP.items() if v == case.entry)
    args += [f"mesh={case.mesh_shape}", f"steps={case.steps}", f"dp={dp!r}", f"dtype=torch.{case.dtype}",
             f"batch={case.global_batch}", f"accumulate={case.accumulate}", f"seed={case.seed}", f"impl={impl!r}"]
    args += [f"loss_parallel={u.loss_parallel}"] if u.loss_parallel else []
    args += [f"ddp_options={dataclasses.asdict(case.ddp)!r}"] if case.ddp != DDPOptions() else []
    args += [f"baseline={baseline!r}"] if baseline else []
    paths = sorted({p for m in imports if (p := _import_root(m))})
    lines = ["import sys", "", "import torch", "", "from tpdp_verify import verify_plan", ""]
    lines += [f"sys.path[:0] = {paths!r}  # the directories of the modules below"] if paths else []
    lines += [f"from {_module_name(m)} import {', '.join(dict.fromkeys(names))}" for m, names in imports.items()]
    lines += written
    lines += ["", 'if __name__ == "__main__":  # the ranks are processes that import this file',
              f"    report = verify_plan({', '.join(args)})", "    print(report)",
              "    raise SystemExit(0 if report.ok else 1)"]
    return "\n".join(lines) + "\n"


def _import_root(module: str) -> str | None:
    """The directory from which ``module`` imports: where its top-level package (or the
    module itself) lies. A package installed under another folder's name (tpdp_verify's
    fixtures) counts from its top package."""
    top = sys.modules.get(module.split(".")[0])
    if getattr(top, "__file__", None) is None:
        return None
    path = Path(top.__file__).resolve()
    return str(path.parents[1] if hasattr(top, "__path__") else path.parent)


def _module_name(module: str) -> str:
    """A module as a script imports it: a script run as __main__ by its file's name."""
    return Path(sys.modules[module].__file__).stem if module in ("__main__", "__mp_main__") else module


def _plan_name(plan: dict, imports: dict[str, list[str]]) -> str | None:
    """The name a plan dict has at a module's top level (the user's functions' modules
    first, then the script's, then any), added to the imports."""
    for module in [*imports, "__main__", *sys.modules]:
        if getattr(sys.modules.get(module), "__file__", None) is None:
            continue  # nowhere to import it from
        for name, value in list(vars(sys.modules[module]).items()):
            if value is plan:
                imports.setdefault(module, []).append(name)
                return name
    return None
