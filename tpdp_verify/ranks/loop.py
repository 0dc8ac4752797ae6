"""The training loop every run of a case shares: the TP+DP ranks, plain DDP and the oracle.

One loop, so the runs differ only in what they are meant to differ in: how the model is
wrapped, which rows of the global batch a run sees, and which part of each global value
a rank holds. What a run saw comes back as a ``Trace`` of plain CPU tensors and Pieces
(tpdp_verify.ranks.pieces), which the parent puts together.
"""

from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from tpdp_verify import signature, torch_internals
from tpdp_verify.cases.training import TrainCase
from tpdp_verify.fixtures.zoo import ZOO, Fixture
from tpdp_verify.ranks import taps
from tpdp_verify.ranks.observation import Observation
from tpdp_verify.ranks.rank import caught

LR = {"sgd": 0.1, "adam": 1e-2}
UNIT = "_fsdp_wrapped_module"  # FSDP1's attribute for a unit's module (auto_wrap_policy nests units)


def user_name(name: str) -> str:
    """A name as the user's model has it: FSDP1's nested units (FSDP1Options.auto_wrap) left out."""
    return ".".join(part for part in name.split(".") if part != UNIT)


def user_named(pairs) -> list[tuple[str, object]]:
    """named_parameters() or named_buffers() pairs, by the names the user's model has."""
    return [(user_name(n), x) for n, x in pairs]


def user_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """named_modules() as the user's model has them: FSDP1's nested unit wrappers left out."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return [(user_name(n), m) for n, m in module.named_modules() if not isinstance(m, FSDP)]


@dataclass
class Trace(Observation):
    """What one training run (one rank, or the oracle) observed, step by step."""

    trainable: list[str] = field(default_factory=list)  # names requiring grad before training
    outputs: list[dict] = field(default_factory=list)  # each microbatch: leaf path -> this run's rows of it
    unread: list[str] = field(default_factory=list)  # output leaves not compared, each with why
    # the float64 run only: each kernel with no float64 path it ran as another kernel of the
    # same library, the same math (oracles.single_device.float64_kernels), said in the report
    substituted: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    # each step: the total gradient norm clipping saw (Habits.clip), as a user logs it: a
    # reading (READINGS) -> its value
    norms: list[dict[str, float]] = field(default_factory=list)
    # each step: the block called directly after it (Habits.between "submodule") and its
    # output as this run holds it (a rank's may be a tp shard: judging puts it back)
    direct: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    grads: list[dict] = field(default_factory=list)  # each step: name -> gradient (or its Piece) or None
    params: list[dict] = field(default_factory=list)  # before training, then after each step
    state: list[dict] = field(default_factory=list)  # each step: "name: key" -> optimizer state
    buffers: list[dict] = field(default_factory=list)  # after each step
    activations: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # first forward
    raised_in: str = ""  # the innermost module whose forward raised, if one did
    raised_split: str = ""  # how TP split its weight, where it is a Linear's: "output" or "input" features
    registry: list[str] = field(default_factory=list)  # named_parameters() of the model after training
    tied: list[tuple[str, ...]] = field(default_factory=list)  # after training: names that share one parameter
    state_unobserved: str = ""  # why the optimizer state was not read, where it was not
    # what DP did to the parameters the user told it to ignore (Habits.ignored): each one it
    # replaced or localized, after wrapping and after training
    ignored: list[str] = field(default_factory=list)
    # what the run went through that a PASS then covers (a plan report lists it): "loss ops"
    # (those loss_parallel computed sharded), "reduced by tp" (trainable parameters TP
    # replicates, whose gradients it sums over tp), "precision" (a DP wrapper's policy)
    exercised: dict[str, list[str]] = field(default_factory=dict)
    # each gradient TP reduced under FSDP2, in order (tpdp_verify.ranks.reductions.Reduction)
    reductions: list = field(default_factory=list)
    # each gradient FSDP2 reduced over dp, in order (tpdp_verify.ranks.reductions.DPReduction)
    dp_reductions: list = field(default_factory=list)


@dataclass
class Run:
    """How one run drives the shared loop."""

    model: nn.Module  # what forward is called on: a DP wrapper or the plain model
    inner: nn.Module  # the user's model inside it
    rows: slice  # this run's rows of every global batch
    part: Callable[[str, torch.Tensor], object] = lambda name, t: t  # a value as this rank holds it
    no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    loss_parallel: bool = False
    handles: dict = field(default_factory=dict)  # name -> parameter, before the first forward
    before_wrap: dict = field(default_factory=dict)  # name -> parameter of the TP'd model
    # Where the wrapper keeps parameters flat-sharded (FSDP1): a context that makes them
    # whole, yielding name -> parameter (with its gradient); and why their optimizer state,
    # flat-sharded too, is not read.
    whole_params: Callable[[], contextlib.AbstractContextManager] | None = None
    state_unobserved: str = ""
    # Habits.ignored == "trained": what the user does for the parameters DP ignores, after
    # the last backward of a step (average their gradients over dp)
    sync_ignored: Callable[[], None] = lambda: None
    ignored: tuple[str, ...] = ()  # names of the parameters DP was told to ignore (Habits.ignored)
    # The SPMD form (TrainCase.dp_mesh_dims): this run's rows as the model takes them (DTensors
    # sharded on dp), and an output's leaves back as this run's rows
    inputs: Callable[[dict], dict] = lambda rows: rows
    rows_of: Callable[[object], object] = lambda out: out

    def take(self, batch: dict) -> dict:
        """This run's rows of a global batch, as its model takes them: every forward's input
        (a constant of input_fn's, plan.case.CONSTANTS, whole)."""
        return self.inputs({k: v[self.rows] if torch.is_tensor(v) else v for k, v in batch.items()})


def fixture(case: TrainCase) -> Fixture:
    """The case's model, plan, data and loss: a zoo model's, or the user's; with the
    case's loss in place of its own where it draws one (tpdp_verify.fixtures.losses)."""
    if case.user is not None:
        return case.user.fixture()
    if case.loss is not None:
        from tpdp_verify.fixtures import losses

        return losses.applied(ZOO[case.model], case.loss)
    return ZOO[case.model]


def build(case: TrainCase, dtype: torch.dtype | None = None) -> nn.Module:
    """The unsharded model, identical wherever it is built from the case's seed; in the
    case's dtype unless told otherwise (the float64 shadow). A module the case's DP entry
    point ignores is frozen here, in every run alike (Habits.ignored)."""
    torch.manual_seed(case.seed)
    model = in_dtype(fixture(case).build(case.size), dtype or case.torch_dtype)
    if case.habits.ignored == "frozen":
        ignorable(model).requires_grad_(False)
    return model


def in_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The model's floating-point parameters and buffers in ``dtype``; a complex buffer (a
    RoPE cache's rotations) complex still, in the precision beside it (complex128 with
    float64, else complex64: the CPU has no complex half), where ``Module.to(dtype)`` would
    drop its imaginary part; integer ones as they are."""
    rotations = torch.complex128 if dtype == torch.float64 else torch.complex64
    return model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t.to(rotations) if t.is_complex() else t)


def ignorable(model: nn.Module) -> nn.Module | None:
    """The module a DP entry point may be told to ignore: the model's first child with
    parameters, where another child has trainable ones (DP needs something to train)."""
    held = [m for m in model.children() if any(True for _ in m.parameters())]
    return held[0] if len(held) > 1 and any(p.requires_grad for m in held[1:] for p in m.parameters()) else None


def blocks(model: nn.Module) -> list[nn.Module]:
    """The modules activation checkpointing wraps: the model's children with parameters,
    the entries of a ModuleList or ModuleDict child in its place (it has no forward)."""
    out = []
    for child in model.children():
        inner = list(child.children()) if isinstance(child, (nn.ModuleList, nn.ModuleDict)) else [child]
        out += [m for m in inner if any(True for _ in m.parameters())]
    return out


def checkpoint_blocks(model: nn.Module) -> None:
    """Activation checkpointing of every block, as torchtitan applies it: after TP, before DP."""
    from torch.distributed._composable import checkpoint

    for block in blocks(model):
        checkpoint(block)


LOOP_KEYS = ("weight", "kept")  # what batches() adds to a fixture's batch, for the loss alone


def batches(case: TrainCase, dtype: torch.dtype | None = None) -> list[list[dict]]:
    """Global batches a step, a microbatch each, with a random weight per sample.

    Weighting samples differently is what exposes DP bugs a ``.sum()`` hides: gradients
    summed instead of averaged, rows routed to the wrong rank, a rank's batch dropped.
    """
    fx, gen = fixture(case), torch.Generator().manual_seed(case.seed + 1)
    dtype = dtype or case.torch_dtype
    steps = []
    for _ in range(case.steps):
        micro = []
        for _ in range(case.accumulate):
            b = fx.batch(gen, case.global_batch, case.size)
            b = {k: v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in b.items()}
            b["weight"] = torch.rand(case.global_batch, generator=gen, dtype=torch.float64).to(dtype)
            if case.loss_reduction == "masked":  # 1 where a row counts, 0 where it is padding
                kept = torch.rand(case.global_batch, generator=gen) < 0.7
                b["kept"] = kept.index_fill(0, torch.tensor([0]), True).to(dtype)
            micro.append(b)
        steps.append(micro)
    return steps


def make_optimizer(case: TrainCase, params) -> torch.optim.Optimizer:
    params = list(params)
    if case.user is not None and case.user.optimizer_fn is not None:
        return case.user.optimizer_fn(params)
    if case.optimizer == "adam":
        # Adam's default eps, 1e-8, is 0 in float16: a gradient whose square underflows
        # divides by zero on one device too. Mixed-precision recipes raise eps for float16.
        return torch.optim.Adam(params, lr=LR["adam"], eps=1e-4 if case.dtype == "float16" else 1e-8)
    return torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9)


def named(run: Run, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's parameters by name: what it will actually update."""
    names: dict[int, str] = {}
    for handles in (run.handles, run.before_wrap):
        for n, p in handles.items():
            names.setdefault(id(p), n)
    held = [p for group in optimizer.param_groups for p in group["params"]]
    return {names.get(id(p), f"<unnamed parameter {i}>"): p for i, p in enumerate(held)}


def forward(run_model: nn.Module, inner: nn.Module, batch: dict):
    """The model called on a batch: its "input" as the one positional argument, or, for a
    batch without one, every key the user's forward names as keyword arguments (a
    transformers model's input_ids, attention_mask, labels, ...)."""
    if "input" in batch:
        return run_model(batch["input"])
    return run_model(**{k: batch[k] for k in model_keys(inner, batch)})


def model_keys(inner: nn.Module, batch: dict) -> list[str]:
    """The batch's keys that ``inner.forward`` takes by name (the loop's own "weight" aside);
    where it takes **kwargs and hands them down, those its modules' forwards name too (Voxtral
    Realtime's text model: its layers' ``t_cond``)."""
    import inspect

    params = inspect.signature(inner.forward).parameters
    named = [k for k, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.kind == p.VAR_KEYWORD for p in params.values()) and not set(batch) <= {*named, *LOOP_KEYS}:
        named += [k for m in inner.modules() for k in inspect.signature(m.forward).parameters]
    return [k for k in batch if k in named and k not in LOOP_KEYS]


def output_leaves(out, rows: int) -> tuple[dict, list[str]]:
    """A model output of any pytree shape (a tensor, a tuple, a dict, transformers'
    ModelOutput) as leaf path -> tensor, for each tensor leaf that holds the batch's rows in
    dim 0 (a DTensor one whole); and every other leaf, with why it is not compared (a
    batch-mean loss is judged as the loss; an object such as a KV cache is no pytree)."""
    import torch.utils._pytree as pytree

    leaves, unread = {}, []
    for path, leaf in pytree.tree_flatten_with_path(out)[0]:
        name = leaf_name(path)
        if isinstance(leaf, torch.Tensor) and leaf.dim() and leaf.shape[0] == rows:
            leaves[name] = whole(leaf.detach()).clone()
        elif isinstance(leaf, torch.Tensor):
            unread.append(f"{name} (shape {list(leaf.shape)}: no dim 0 of the batch's {rows} rows to put together)")
        elif leaf is not None:
            unread.append(f"{name} (a {type(leaf).__name__}, not a tensor)")
    return leaves, unread


def leaf_name(path) -> str:
    """A pytree path as a user writes it: ``logits``, ``past_key_values[0][1]``, ``model`` for a bare tensor."""
    import torch.utils._pytree as pytree

    text = ""
    for key in path:
        if isinstance(key, pytree.MappingKey):
            text += f".{key.key}" if isinstance(key.key, str) and key.key.isidentifier() else f"[{key.key!r}]"
        elif isinstance(key, pytree.SequenceKey):
            text += f"[{key.idx}]"
        else:
            text += f".{getattr(key, 'name', key)}"
    return text.lstrip(".") or "model"


def weighted_loss(per_sample: torch.Tensor, batch: dict, case: TrainCase) -> torch.Tensor:
    """The loss a run backpropagates: each sample's loss weighted by a random weight and
    averaged (or reduced as the case's loss_reduction says), which exposes DP averaging bugs
    a plain mean hides; a loss the model already averaged over its batch (a scalar, as
    transformers' ``labels`` give) as it is."""
    from torch.distributed.tensor import DTensor

    weight = batch["weight"]
    if not isinstance(weight, DTensor):  # else the SPMD form's: both sharded alike on dp, reduced by DTensor
        per_sample = whole(per_sample)
    if per_sample.dim() == 0:
        return per_sample
    weighted = weight * per_sample
    if case.loss_reduction == "sum":
        return weighted.sum()
    if case.loss_reduction == "sum_over_count":  # the global batch's count: what the SPMD form's sum covers
        return weighted.sum() / case.global_batch
    if case.loss_reduction == "masked":  # the kept rows' count over the global batch, as DTensor sums it
        return (weighted * batch["kept"]).sum() / batch["kept"].sum()
    return weighted.mean()


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


@contextlib.contextmanager
def recording(run: Run, into: list):
    """Record every module's output, in forward order, while the block runs."""

    def hook(name):
        def record(module, args, output):
            t = _first_tensor(output)
            if t is not None:
                into.append((name, whole(t.detach()).clone()))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in user_modules(run.inner)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


LOSS = "<loss>"  # on the stack of running modules while the per-sample loss is computed


def whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank calls it alike), a tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def snapshot(run: Run, values: dict) -> dict:
    return {n: None if v is None else run.part(n, v.detach().clone()) for n, v in values.items()}


def held_params(run: Run):
    return run.whole_params() if run.whole_params else contextlib.nullcontext(run.handles)


def optimizer_state(run: Run, params: dict, optimizer) -> dict:
    out = {}
    for name, p in params.items():
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                out[f"{name}: {key}"] = run.part(name if value.dim() else "", value.detach().clone())
    return out


def build_optimizer(case: TrainCase, run: Run, data: list, new_optimizer: Callable[[], torch.optim.Optimizer]
           ) -> torch.optim.Optimizer:
    """The optimizer; a case that builds it after a forward first makes a no_grad forward,
    in every run alike (it moves buffers such as step counters)."""
    if case.built == "after_forward":
        with torch.no_grad():
            forward(run.model, run.inner, run.take(data[0][0]))
    try:
        return new_optimizer()
    except Exception as exc:
        raise RuntimeError(f"building the optimizer {case.built.replace('_', ' ')}: "
                           + "".join(traceback.format_exception_only(exc)).strip()) from None


# How a user reads the total norm a clip returns, on each rank: the number as it comes (a
# DTensor's is its local value), and the whole value
READINGS = (".item()", "full_tensor()")


def clip(run: Run, habits) -> dict[str, float]:
    """Clipping over the model's parameters as users write it after wrapping (FSDP1's own
    method where the wrapper has one; else ``habits.clip_by``), by ``habits.norm_type``'s
    norm; the total norm it saw, as each of READINGS gives it."""
    p = float(habits.norm_type)
    if hasattr(run.model, "clip_grad_norm_"):
        norm = run.model.clip_grad_norm_(habits.clip, norm_type=p)
    elif habits.clip_by == "get_total_norm":  # torchtitan's dist_utils.clip_grad_norm_
        params = list(run.model.parameters())
        norm = whole(torch.nn.utils.get_total_norm([g.grad for g in params if g.grad is not None], norm_type=p))
        torch.nn.utils.clip_grads_with_norm_(params, habits.clip, norm)
    else:
        norm = torch.nn.utils.clip_grad_norm_(list(run.model.parameters()), habits.clip, norm_type=p)
    return dict(zip(READINGS, (norm.item(), whole(norm).item())))


def between_steps(case: TrainCase, run: Run, batch: dict, called: dict, trace: Trace) -> None:
    """What the case does between steps, training nothing: a forward in eval mode or in
    train mode under no_grad, or, under no_grad, the last block the step's forward ran
    called directly on what the model gave it (``called``: see ``calls``)."""
    if case.habits.between == "submodule":
        if "last" not in called:
            raise RuntimeError("calling a block directly between steps: the step's forward ran no block")
        name, block, args, kwargs = called.pop("last")  # each step calls the block its own forward ran
        try:
            with torch.no_grad():
                out = _first_tensor(block(*args, **kwargs))
        except Exception as exc:
            raise RuntimeError(f"calling {name} directly between steps: "
                               + "".join(traceback.format_exception_only(exc)).strip()) from None
        if out is not None:
            trace.direct.append((name, whole(out.detach()).clone()))
    elif case.habits.between:
        if case.habits.between == "eval":
            run.model.eval()
        with torch.no_grad():
            forward(run.model, run.inner, run.take(batch))
        run.model.train()


@contextlib.contextmanager
def calls(run: Run, candidates: list[nn.Module], into: dict):
    """Keep ``into["last"]``: the last of the blocks ``candidates`` the forward
    ran, with its name and a copy of the arguments its parent passed (ahead of TP's input
    hooks). The blocks are found before the first forward: after it, torch 2.13's DDP
    transform leaves TP blocks no registered parameter (known-divergences.md, fault 1)."""
    if not candidates:
        yield
        return
    import torch.utils._pytree as pytree

    def hook(name):
        def keep(module, args, kwargs):
            copy = pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
            into["last"] = (name, module, *copy)
        return keep

    names = {id(m): n for n, m in user_modules(run.inner)}
    handles = [b.register_forward_pre_hook(hook(names[id(b)]), prepend=True, with_kwargs=True)
               for b in candidates]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def train(case: TrainCase, run: Run, new_optimizer: Callable[[], torch.optim.Optimizer],
          capture: bool = False, dtype: torch.dtype | None = None) -> Trace:
    """Run the case's steps; record a Trace. An exception ends the trace with its text."""
    fx, trace = fixture(case), Trace(state_unobserved=run.state_unobserved)
    trace.trainable = [n for n, p in run.handles.items() if p.requires_grad]
    trace.ignored = left_as_they_were(case, run, "after wrapping")
    # Habits.between "submodule": the blocks that may be called directly, and the last called
    direct, called = (blocks(run.inner) if case.habits.between == "submodule" else []), {}
    running: list[str] = []  # modules whose forward has begun and not returned
    sharded_loss_ops: set[str] = set()
    try:
        with held_params(run) as current:
            trace.params.append(snapshot(run, current))
        data = batches(case, dtype)
        # Before any forward unless built after one: FSDP2 unshards the root in a forward.
        optimizer = None if case.built == "after_forward" else build_optimizer(case, run, data, new_optimizer)
        if case.eval_first:
            run.model.eval()
            with torch.no_grad():
                forward(run.model, run.inner, run.take(data[0][0]))
            run.model.train()
        optimizer = optimizer or build_optimizer(case, run, data, new_optimizer)
        params = named(run, optimizer)
        for step, micro in enumerate(data):
            for m, b in enumerate(micro):
                local = run.take(b)
                sync = contextlib.nullcontext() if m == len(micro) - 1 else run.no_sync()
                record = recording(run, trace.activations) if capture and step == m == 0 else contextlib.nullcontext()
                with sync, maybe_loss_parallel(run.loss_parallel, sharded_loss_ops):
                    with record, calls(run, direct if m == 0 else [], called), tracking(run.inner, running):
                        out = forward(run.model, run.inner, local)
                    running.append(LOSS)
                    loss = weighted_loss(fx.per_sample_loss(out, local), local, case)
                    running.pop()
                    loss.backward()
                leaves, trace.unread = output_leaves(run.rows_of(out), len(b["weight"][run.rows]))
                trace.outputs.append(leaves)
                trace.losses.append(float(whole(loss.detach())))
            run.sync_ignored()
            if case.habits.clip is not None:
                trace.norms.append(clip(run, case.habits))
            with held_params(run) as current:
                trace.grads.append(snapshot(run, {n: p.grad for n, p in current.items()}))
            optimizer.step()
            optimizer.zero_grad(set_to_none=case.habits.set_to_none)
            between_steps(case, run, micro[0], called, trace)
            with held_params(run) as current:
                trace.params.append(snapshot(run, current))
            trace.state.append({} if run.state_unobserved else optimizer_state(run, params, optimizer))
            trace.buffers.append({n: whole(b.detach()).clone() for n, b in user_named(run.inner.named_buffers())})
        trace.registry = [n for n, _ in user_named(run.inner.named_parameters())]
        trace.tied = _tied(run.inner)
        trace.ignored += left_as_they_were(case, run, "after training")
    except Exception as exc:  # a run that raises is a finding about it, not a crash of ours
        inside = running[-1] if running else None
        trace.raised_in = "" if inside in (None, LOSS) else inside or "<the whole model>"
        trace.raised_split = tp_split(run.inner, trace.raised_in)
        where = ("in the per-sample loss (loss_fn): " if inside == LOSS else
                 f"in the forward of {trace.raised_in}: " if running else "")
        trace.error = where + "".join(traceback.format_exception_only(exc)).strip() + signature.innermost(exc)
        trace.raised = signature.raised(exc)
        caught(trace.error, trace.raised)
    if run.loss_parallel:
        trace.exercised["loss ops"] = sorted(sharded_loss_ops)
    return trace


def tp_split(model: nn.Module, name: str) -> str:
    """How TP splits the weight of the Linear ``name``: "output" features (ColwiseParallel's),
    "input" features (RowwiseParallel's); "" where it is no Linear or holds no DTensor (a DP
    transform localized it)."""
    from torch.distributed.tensor import DTensor, Shard

    try:
        module = model.get_submodule(name)
    except AttributeError:
        return ""
    weight = getattr(module, "weight", None)
    if not isinstance(module, nn.Linear) or not isinstance(weight, DTensor):
        return ""
    names = weight.device_mesh.mesh_dim_names or ()
    placement = weight.placements[names.index("tp") if "tp" in names else -1]
    return {0: "output", 1: "input"}.get(placement.dim % 2, "") if isinstance(placement, Shard) else ""


def left_as_they_were(case: TrainCase, run: Run, when: str) -> list[str]:
    """How the parameters DP was told to ignore differ from what the user left before
    wrapping: each one that is another object now, or no longer the DTensor it was (localized).
    A DP entry point's contract is to leave them alone; the user trains them, or froze them.
    Looked up by name, registered or not: torch 2.13's transform unregisters TP parameters."""
    from torch.distributed.tensor import DTensor

    out = []
    for name in run.ignored:
        owner, _, attr = name.rpartition(".")
        left, now = run.before_wrap[name], getattr(run.inner.get_submodule(owner), attr, None)
        if isinstance(left, DTensor) and not isinstance(now, DTensor):
            out.append(f"{name} is {'gone' if now is None else 'localized'} {when} (a DTensor the user left)")
        elif now is not left:
            out.append(f"{name} is replaced {when}")
    return out


def _tied(model: nn.Module) -> list[tuple[str, ...]]:
    """The groups of names under which one parameter is registered (an embedding tied to its head)."""
    names: dict[int, list[str]] = {}
    for name, p in user_named(model.named_parameters(remove_duplicate=False)):
        names.setdefault(id(p), []).append(name)
    return [tuple(group) for group in names.values() if len(group) > 1]


@contextlib.contextmanager
def tracking(module: nn.Module, running: list[str]):
    """Keep ``running`` the names of the modules inside whose forward we are, innermost
    last: an exception leaves it naming the module that raised."""

    def enter(name):
        return lambda m, args: running.append(name)

    def leave(m, args, output):
        running.pop()

    handles = [h for n, m in user_modules(module)
               for h in (m.register_forward_pre_hook(enter(n)), m.register_forward_hook(leave))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def maybe_loss_parallel(on: bool, seen: set[str] | None = None):
    """loss_parallel() where the run's loss is over vocab-sharded logits; ``seen`` collects
    the ops its sharded handlers computed (what a plan report says the loss exercised)."""
    if not on:
        yield
        return
    from torch.distributed.tensor.parallel import loss, loss_parallel

    handlers = loss.customized_loss_ops  # read when loss_parallel() enters and exits
    if seen is not None:
        loss.customized_loss_ops = {op: taps.noting(op, handler, seen) for op, handler in handlers.items()}
    table = torch_internals.custom_op_handlers()
    before = dict(table)
    try:
        with loss_parallel():
            yield
    finally:
        loss.customized_loss_ops = handlers
        # A body that raises leaves loss_parallel's handlers installed (fault 32, torch 2.13):
        # every later loss of the process would run them, the next run's of this call
        # included. The table is put back as loss_parallel's own exit leaves it.
        table.clear()
        table.update(before)

