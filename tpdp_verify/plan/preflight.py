"""The mistakes a verify_plan call can hold, found before training: in this process (the
user's callables, the plan's keys and styles, the batch and the loss) and on the ranks
(the plan or parallelize function on the mesh, weights alike everywhere)."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import pickle
import warnings

import torch
from torch import nn

from tpdp_verify.cases.training import TrainCase
from tpdp_verify.errors import UsageError
from tpdp_verify.plan.case import UserModel, as_batch, mean_square, name_of
from tpdp_verify.styles import resolve


def _sendable(user: UserModel) -> None:
    for field in ("model_fn", "plan", "parallelize_fn", "dp_alone_fn", "input_fn", "loss_fn", "optimizer_fn"):
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
        if isinstance(value, torch.Tensor) and (value.dim() == 0 or len(value) != n):
            shape = list(value.shape)
            raise UsageError(f"input_fn({n}, generator) returned {key!r} of shape {shape}: dim 0 must hold "
                             f"the {n} samples asked for, {case.local_batch} for each of the {case.dp} dp ranks")
    if any(not _same(batches[0][k], batches[1][k]) for k in batches[0]):
        raise UsageError("input_fn returned different batches for the same generator: draw every random "
                         "value from the generator it is given (torch.randn(..., generator=generator))")
    batch = {k: v.to(case.torch_dtype) if torch.is_tensor(v) and v.is_floating_point() else v
             for k, v in batches[0].items()}
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


def _same(a, b) -> bool:
    """Two draws of one input_fn key alike: a tensor's values, a constant's."""
    return torch.equal(a, b) if torch.is_tensor(a) and torch.is_tensor(b) else type(a) is type(b) and a == b


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
            near = difflib.get_close_matches(key, _as_written(key, [m for m in modules if m]), n=3, cutoff=0.5)
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
                                f"{type(module).__name__}; it shards only {' and '.join(t.__name__ for t in kinds)}"
                                + _fitting(module))
            elif dim is not None and module.weight.shape[dim] < tp:
                problems.append(f"plan key {key!r}: {type(style).__name__} shards dim {dim} of {path}.weight "
                                f"(size {module.weight.shape[dim]}) over {tp} tp ranks, so some rank would hold "
                                f"none of it; widen it to at least {tp} or leave {path!r} out of the plan")
            elif dim == 0 and isinstance(module, nn.Linear):
                problems += _split_heads(key, path, module, modules.get(path.rpartition(".")[0]), tp)
    return problems


def _as_written(key: str, paths: list[str]) -> list[str]:
    """The module paths as the key writes them: where the key has a wildcard atom, the path's
    atom there is the wildcard too, so a suggestion keeps it (``layers.*.attn.o_proj``, not
    ``layers.1.attn.o_proj``, for ``layers.*.attn.o_prj``)."""
    atoms = key.split(".")
    wild = [i for i, a in enumerate(atoms) if any(c in a for c in "*?[")]
    out = []
    for path in paths:
        parts = path.split(".")
        if len(parts) == len(atoms):
            parts = [atoms[i] if i in wild else p for i, p in enumerate(parts)]
        out.append(".".join(parts))
    return list(dict.fromkeys(out))


def _fitting(module: nn.Module) -> str:
    """The style that fits a module a sharding style does not: a norm is SequenceParallel's,
    a module that holds others takes its inputs' and outputs' layouts."""
    name = type(module).__name__
    if "Norm" in name:
        return f"; a {name} runs on sequence shards: SequenceParallel()"
    if any(True for _ in module.children()):
        return (f"; for a {name} (a module of modules), give its children their styles, or lay out its input "
                "and output with PrepareModuleInput / PrepareModuleOutput")
    if not any(True for _ in module.parameters(recurse=False)):
        return f"; a {name} holds no parameter to shard: leave it out of the plan"
    return ""


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


def _checksums(model: nn.Module) -> dict[str, str]:
    """Each parameter's and buffer's bytes, digested: equal exactly where the values are.
    (A float sum is not: its order, and so its last bits, follow the process's thread count,
    and the ranks run one thread where this process runs several.)"""
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        out[name] = hashlib.blake2b(data, digest_size=16).hexdigest()
    return out


def preflight(case: TrainCase) -> tuple[list[str], dict]:
    """On every rank: the plan's problems for the model this rank builds, and its checksums.

    parallelize_module skips a plan key it cannot resolve with a warning and trains a half
    parallelized model; here its warnings are problems too.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from tpdp_verify.ranks.loop import build, fixture
    from tpdp_verify.ranks.rank import device_mesh
    from tpdp_verify.ranks.tp_dp import plan_for

    mesh = device_mesh(case.mesh_shape, case.mesh_dims)
    model = build(case)
    sums = _checksums(model)
    if case.user.parallelize_fn is not None:
        return _parallelize_problems(case.user.parallelize_fn, model, mesh, case.entry == "own", case.dp), sums
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


def _parallelize_problems(parallelize_fn, model: nn.Module, mesh, own_dp: bool, dp: int) -> list[str]:
    """What is wrong with what a user's parallelize function does to the model; a plan key
    it cannot resolve is a problem too (parallelize_module only warns). Over one dp rank a
    function that wraps DP itself may apply none (transformers shards with FSDP2 only where
    fsdp_size > 1)."""
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
    if own_dp and entry is None and dp > 1:
        return [f"parallelize_fn {name} applied no DP, and dp='own' says it does: wrap the model in DDP, "
                "replicate, fully_shard or FSDP on mesh['dp'] and return the wrapper, or pass dp='ddp' (or "
                "another) for tpdp-verify to wrap it"]
    if not own_dp and entry is not None:
        return [f"parallelize_fn {name} wrapped the model in DP ({entry}) itself: pass dp='own', so that "
                "tpdp-verify drives your wrapper instead of wrapping it again"]
    wiring = _wiring_problems(out, mesh, name, entry)
    if wiring:
        return wiring
    if not tp_sharded(out, shapes) and not ep_sharded(out):  # EP alone shards (its rules drop TP's on experts)
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
    if group is None or "dp" not in mesh.mesh_dim_names:  # a 3-D mesh's DP is a 2-D mesh: no one group
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


def ep_sharded(model: nn.Module) -> list[str]:
    """The parameters expert parallelism holds apart: DTensors on a mesh with an ep dimension
    (transformers' EP: the experts split by expert over ("efsdp", "ep"))."""
    from torch.distributed.tensor import DTensor

    return [n for n, p in model.named_parameters(remove_duplicate=False)
            if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())]


def check_on_ranks(pool, case: TrainCase) -> tuple[int, int, str, str]:
    """Run ``preflight`` on every rank; raise the first problem; return how many plan keys
    were checked (or parameters a parallelize function sharded by TP), how many parameters
    it sharded by EP, the DP entry point the ranks train under (the one a parallelize
    function applied itself, for dp="own") and how it sees the mesh (TrainCase.dp_mesh_dims).
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
    keys = len(user.plan) if not callable(user.plan) else len(pool.run(_plan_keys, case)[0])
    return keys, 0, case.entry, case.dp_mesh_dims


def _plan_keys(case: TrainCase) -> list[str]:
    from tpdp_verify.ranks.loop import fixture
    from tpdp_verify.ranks.rank import device_mesh
    from tpdp_verify.ranks.tp_dp import plan_for

    return list(plan_for(fixture(case), case, device_mesh(case.mesh_shape, case.mesh_dims)["tp"]))


def _sharded(case: TrainCase) -> tuple[int, int, str, str]:
    """On every rank: how many parameters the user's parallelize function holds apart by
    TP and by EP, the DP entry point it trains under and how that sees the mesh."""
    from tpdp_verify.ranks.entries import own_entry, spmd_form
    from tpdp_verify.ranks.loop import build, fixture
    from tpdp_verify.ranks.rank import device_mesh
    from tpdp_verify.ranks.tp_dp import apply_tp

    model = build(case)
    shapes = {n: p.shape for n, p in model.named_parameters(remove_duplicate=False)}
    model = apply_tp(fixture(case), case, model, device_mesh(case.mesh_shape, case.mesh_dims))
    if case.entry != "own":
        return len(tp_sharded(model, shapes)), len(ep_sharded(model)), case.entry, case.dp_mesh_dims
    return len(tp_sharded(model, shapes)), len(ep_sharded(model)), own_entry(model), spmd_form(model)
