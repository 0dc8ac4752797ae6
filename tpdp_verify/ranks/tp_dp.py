"""Run a case on every rank: the TP+DP run under test, and the plain-DDP run beside it.

Functions here are sent to ranks by ``RankPool.run``; each returns the rank's ``Trace``,
every value as the rank holds it (a whole tensor or its Piece of one), for the parent to
put together and compare.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback

import torch
from torch.distributed.tensor import DTensor

from tpdp_verify import signature, torch_internals
from tpdp_verify.cases.training import DTENSOR, TrainCase
from tpdp_verify.ranks.loop import (Run, Trace, build, checkpoint_blocks, fixture, ignorable, make_optimizer, train,
                                    user_named)
from tpdp_verify.ranks.pieces import cut
from tpdp_verify.ranks.rank import caught
from tpdp_verify.ranks.reductions import DPReduction, Reduction, unobservable, watching, watching_dp

def dp_rank(case: TrainCase, mesh) -> int:
    """This rank's place among the dp ranks: its coordinate over the dp dimensions, row-major
    (dp_replicate outer, as HSDP orders its replicas' shards)."""
    rank = 0
    for name in case.dp_dims:
        rank = rank * mesh.size(mesh.mesh_dim_names.index(name)) + mesh.get_local_rank(name)
    return rank


def dp_group(case: TrainCase, mesh):
    """The process group of every dp rank beside this one (one tp coordinate): mesh["dp"]'s,
    or the dp dimensions of a 3-D mesh flattened."""
    if len(case.dp_dims) == 1:
        return mesh["dp"].get_group()
    return mesh[case.dp_dims]._flatten("dp").get_group()


def parter(specs: dict):
    """``part(name, value)``: the Piece of a global value this rank holds, for the parent to
    put together (tpdp_verify.ranks.pieces).

    A value is a DTensor, or a local shard of the parameter ``name`` whose layout was
    recorded from the TP'd model before any DP wrapper touched it (so a transform that
    garbles its own record of the layout cannot fool the assembly), or already whole.
    A Partial layout (a pending sum, which no parameter, gradient or state should have)
    is gathered here, by every rank that holds the value.
    """

    def part(name: str, value: torch.Tensor):
        if isinstance(value, DTensor):
            piece = cut(value.to_local(), value.device_mesh, value.placements, value.shape)
            return value.full_tensor() if piece is None else piece
        spec = specs.get(name)
        if spec is None:
            return value
        piece = cut(value, spec.mesh, spec.placements, spec.shape)
        if piece is not None:
            return piece
        return DTensor.from_local(value, spec.mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=spec.stride).full_tensor()

    return part


def plan_for(fx, case: TrainCase, tp_mesh) -> dict:
    """The fixture's plan; a user's plan may be a function of the tp mesh."""
    plan = fx.plan(case.size)
    return plan(tp_mesh) if callable(plan) else plan


def apply_tp(fx, case: TrainCase, model, mesh):
    """TP as the fixture applies it: its own parallelize function on the (dp, tp) mesh, or
    parallelize_module with its plan on the tp sub-mesh. Returns the TP'd model."""
    from torch.distributed.tensor.parallel import parallelize_module

    if fx.parallelize is not None:
        out = fx.parallelize(model, mesh)
        return model if out is None else out
    tp_mesh = mesh["dp"] if case.wiring == "tp_over_dp" else mesh["tp"]  # a miswiring (TrainCase.wiring)
    return parallelize_module(model, tp_mesh, plan_for(fx, case, tp_mesh))


def _failed(stage: str, exc: Exception) -> Trace:
    trace = Trace(error=f"{stage}: " + "".join(traceback.format_exception_only(exc)).strip() + signature.innermost(exc),
                  raised=signature.raised(exc))
    caught(trace.error, trace.raised)
    return trace


def replicated_buffers(model, tp_mesh) -> None:
    """Habits.buffers "dtensor": each buffer a DTensor replicated over tp, as torchtitan holds
    its RoPE cache."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    for name, b in list(model.named_buffers()):
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = distribute_tensor(b, tp_mesh, [Replicate()])


def tp_model(case: TrainCase, mesh, tp: bool = True, seed: int | None = None):
    """The case's model from ``seed`` (default the case's), TP'd on mesh["tp"] unless ``tp``
    is False: (model, its parameters before any DP wrapper, the optimizer the case builds
    before wrapping or None)."""
    fx, seeded = fixture(case), case if seed is None else dataclasses.replace(case, seed=seed)
    model = build(seeded)
    if tp and case.dp_mesh_dims:
        model = on_the_whole_mesh(case, model, mesh)
        if not _held_by(model, mesh):  # fault 42: an earlier case's equal mesh, handed back by
            # DTensor's caches, which fully_shard's SPMD form refuses; in a fresh process the
            # parameters hold the mesh they were made on, so they are made so again
            torch_internals.clear_sharding_caches()
            model = on_the_whole_mesh(case, build(seeded), mesh)
    elif tp:
        model = apply_tp(fx, case, model, mesh)
        if fx.after_parallelize is not None:
            fx.after_parallelize(model)
        if case.habits.buffers == "dtensor":
            replicated_buffers(model, mesh["tp"])
        if case.habits.ignored == "frozen":  # frozen again after TP, as users who freeze a parallelized
            # model do: SequenceParallel drops requires_grad (docs/known-divergences.md, fault 7)
            ignorable(model).requires_grad_(False)
    elif case.entry == "own" and fx.dp_alone is not None:  # the user's own DP without TP: the plain-DP run
        out = fx.dp_alone(model, mesh)
        model = model if out is None else out
    if case.habits.checkpoint:
        checkpoint_blocks(model)
    before = dict(model.named_parameters(remove_duplicate=False))
    early = make_optimizer(case, model.parameters()) if case.built == "before_wrap" else None
    return model, before, early


def _held_by(model, mesh) -> bool:
    """Whether every DTensor parameter of ``model`` holds ``mesh`` itself (not an equal one)."""
    return all(p.device_mesh is mesh for p in model.parameters() if isinstance(p, DTensor))


def on_the_whole_mesh(case: TrainCase, model, mesh):
    """The SPMD form (TrainCase.dp_mesh_dims): each parameter a DTensor on the whole mesh,
    Replicate() on the dp dimensions and placed on tp as the plan's styles place it (read from
    a twin parallelized on mesh["tp"]), each buffer replicated (or sharded on tp: Habits.buffers).
    No style's hooks are left: the forward is DTensor's own program over inputs sharded on dp
    (``spmd_io``), as fully_shard's dp_mesh_dims expects."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if case.entry == DTENSOR and len(case.dp_dims) == 2:  # with no DP wrapper, the flattened dp submesh a trainer
        mesh[case.dp_dims]._flatten("dp")  # builds beside the dims (torchtitan's ParallelDims: its data loader's)
    twin = apply_tp(fixture(case), case, build(case), mesh)
    placed = {n: p.placements for n, p in twin.named_parameters(remove_duplicate=False) if isinstance(p, DTensor)}
    made: dict[int, nn.Parameter] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if id(p) not in made:  # a tied parameter stays one
            where = (Replicate(),) * len(case.dp_dims) + placed.get(name, (Replicate(),))
            made[id(p)] = nn.Parameter(distribute_tensor(p.detach(), mesh, where), requires_grad=p.requires_grad)
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner), attr, made[id(p)])
    sharded = case.habits.buffers == "sharded"
    for name, b in list(model.named_buffers()):  # replicated everywhere, as distribute_module leaves them
        owner, _, attr = name.rpartition(".")
        on_tp = Shard(0) if sharded and b.ndim else Replicate()
        model.get_submodule(owner)._buffers[attr] = distribute_tensor(b, mesh, (Replicate(),) * len(case.dp_dims)
                                                                      + (on_tp,))
    return model


def spmd_io(case: TrainCase, mesh, spmd=None) -> dict:
    """Run's ``inputs`` and ``rows_of`` for the SPMD form: this rank's rows as DTensors sharded
    on every dp dimension (Replicate() on tp), and an output's batch-shaped DTensor leaves
    back as this rank's rows (the others whole). ``spmd``: a user's own DP took a whole mesh
    (Wrapped.spmd, entries.SpmdBatch): the batch is split on that mesh's dp dims."""
    if not (case.dp_mesh_dims or spmd):
        return {}
    import torch.utils._pytree as pytree
    from torch.distributed.tensor import Replicate, Shard

    if spmd is not None and spmd.mesh is not None:  # a dp dim of one rank replicates, as a trainer places it
        mesh = spmd.mesh  # (torchtitan's parallelize_inputs); a torch that keeps no spmd_mesh: the harness's
        rows = tuple(Shard(0) if name in spmd.dp_dims and size > 1 else Replicate()
                     for name, size in zip(mesh.mesh_dim_names, mesh.shape))
    else:
        rows = (Shard(0),) * len(case.dp_dims) + (Replicate(),)

    def inputs(local: dict) -> dict:
        # the global shape given: a batch that does not divide over the dp dims (batch_short)
        # leaves the ranks' rows uneven, which from_local cannot infer
        return {k: DTensor.from_local(v, mesh, rows, run_check=False, shape=(case.global_batch, *v.shape[1:]),
                                      stride=torch.empty(case.global_batch, *v.shape[1:], device="meta").stride())
                if torch.is_tensor(v) else v for k, v in local.items()}

    def rows_of(out):
        def local(t):
            if not isinstance(t, DTensor):
                return t
            batch = t.dim() and t.shape[0] == case.global_batch
            return t.redistribute(mesh, rows).to_local() if batch else t.full_tensor()
        return pytree.tree_map_only(torch.Tensor, local, out)

    return {"inputs": inputs, "rows_of": rows_of}


def run_of(case: TrainCase, wrapped, mesh, before: dict) -> Run:
    """How ``train`` drives the wrapped model on this rank's rows. The layouts are recorded
    from ``before`` (the TP'd parameters) so that a transform that garbles its own record
    of them cannot fool the assembly."""
    specs = {n: p._spec for n, p in before.items() if isinstance(p, DTensor)} | (wrapped.layouts or {})
    return Run(wrapped.model, wrapped.inner, case.rows(dp_rank(case, mesh)),
               part=parter(specs), no_sync=wrapped.no_sync, loss_parallel=fixture(case).loss_parallel,
               handles=dict(user_named(wrapped.inner.named_parameters(remove_duplicate=False))),
               before_wrap=before, whole_params=wrapped.whole_params,
               state_unobserved=wrapped.state_unobserved, sync_ignored=averaging_ignored(case, wrapped, mesh),
               ignored=ignored_names(case, wrapped.inner, before), **spmd_io(case, mesh, wrapped.spmd))


def ignored_names(case: TrainCase, inner, before: dict) -> tuple[str, ...]:
    """The names of the parameters the case tells DP to ignore, as the TP'd model had them."""
    skip = ignorable(inner) if case.habits.ignored else None
    if skip is None:
        return ()
    mine = {id(p) for p in skip.parameters()}
    prefix = next(f"{n}." for n, m in inner.named_children() if m is skip)
    return tuple(n for n, p in before.items() if n.startswith(prefix) or id(p) in mine)


def averaging_ignored(case: TrainCase, wrapped, mesh):
    """What a user who trains the parameters DP ignores does each step: average their
    gradients over the dp ranks (a DTensor's local shard, each tp rank its own)."""
    if case.habits.ignored != "trained" or case.dp_mesh_dims:  # SPMD: the DTensor program reduces them itself
        return lambda: None
    import torch.distributed as dist

    # the module as the wrapped model holds it now: a transform that unregistered its
    # parameters leaves nothing to average (the registry checks say so), never an error here
    ignored = ignorable(wrapped.inner)
    params, group = [] if ignored is None else list(ignored.parameters()), dp_group(case, mesh)

    def average():
        for p in params:
            if p.grad is not None:
                dist.all_reduce(p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad,
                                op=dist.ReduceOp.AVG, group=group)

    return average


def observe(case: TrainCase, impl_name: str, capture: bool = False, tp: bool = True, dp: bool = True) -> Trace:
    """On every rank: TP on the tp sub-mesh, the case's DP entry point, K steps.

    With ``tp=False`` the unsharded model goes through the same entry point on the same
    dp groups (the transform finds no DTensor and does nothing): the plain-DP oracle. With
    ``dp=False`` no DP wrapper at all: for the SPMD form, DTensor itself reduces the
    gradients over dp, the oracle of fully_shard's dp_mesh_dims.
    """
    from tpdp_verify.impls.select import installed, load
    from tpdp_verify.ranks.entries import WRAP, Wrapped, precision
    from tpdp_verify.ranks.rank import device_mesh

    impl = load(impl_name)
    mesh = device_mesh(case.mesh_shape, case.mesh_dims)
    with installed(impl):
        model, before, early = tp_model(case, mesh, tp)
        try:
            wrapped = WRAP[case.entry](model, case, mesh, impl) if dp else Wrapped(model, model, contextlib.nullcontext)
        except Exception as exc:
            return _failed(f"wrapping with {case.entry}", exc)
        run = run_of(case, wrapped, mesh, before)
        reduced: list[Reduction] = []
        reduced_over_dp: list[DPReduction] = []
        over_dp = watching_dp(reduced_over_dp) if case.dp > 1 else contextlib.nullcontext()  # a dp of 1 sums nothing
        with watching(reduced), over_dp:
            trace = train(case, run, lambda: early or make_optimizer(case, run.model.parameters()), capture)
    trace.reductions, trace.dp_reductions = reduced, reduced_over_dp
    trace.exercised |= {"reduced by tp": reduced_by_tp(before), "sharded per part": sharded_per_part(before),
                        "precision": precision(wrapped.model), "unobservable": unobservable(case)}
    return trace


def sharded_per_part(before: dict) -> list[str]:
    """The parameters TP shards per part (a fused projection: each tp rank a block of each
    of the rows' parts, ``_StridedShard``), where FSDP2's dp shard departs (fault 36)."""
    from tpdp_verify.torch_internals import split_factor

    out = []
    for name, p in before.items():
        dims = p.device_mesh.mesh_dim_names or () if isinstance(p, DTensor) else ()
        if "tp" in dims:
            i = dims.index("tp")
            out += [name] if split_factor(p.placements[i]) > 1 and p.device_mesh.size(i) > 1 else []
    return out


def reduced_by_tp(before: dict) -> list[str]:
    """The trainable parameters TP replicates over more than one tp rank: each rank's
    gradient is a partial sum that TP reduces (SequenceParallel's norms, a Rowwise bias, a
    tied embedding)."""
    out = []
    for name, p in before.items():
        dims = p.device_mesh.mesh_dim_names or () if isinstance(p, DTensor) else ()
        if p.requires_grad and "tp" in dims:
            i = dims.index("tp")
            out += [name] if p.placements[i].is_replicate() and p.device_mesh.size(i) > 1 else []
    return out
