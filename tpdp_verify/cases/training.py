"""A training case: plain, printable, picklable data that every rank and the oracle rebuild.

``repr`` of a case is constructor code, so a shrunk falsifying example replays by pasting it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields

# Data-parallel entry points, in the order the strategy shrinks toward.
ENTRIES = (
    "ddp_mesh",         # DistributedDataParallel(model, device_mesh=mesh["dp"])
    "transform_ddp",    # _pre_dp_module_transform(model), then DDP on the dp process group
    "replicate",        # composable replicate(model, device_mesh=mesh["dp"])
    "fsdp1",            # FullyShardedDataParallel(model, device_mesh=mesh["dp"]): DTensorExtensions
    "fully_shard",      # FSDP2 fully_shard(model, mesh=mesh["dp"]): DTensor parameters on the 2-D mesh
    "replicate_fsdp",   # FSDP2-based replicate(model, mesh=mesh["dp"]) (_composable.replicate_with_fsdp)
)
# verify_plan's names for them (tpdp_verify.plan); "own": the user's parallelize function
# applies DP itself (tpdp_verify.ranks.entries.wrap_own finds which).
DP = {"ddp": "transform_ddp", "ddp_mesh": "ddp_mesh", "replicate": "replicate",
      "fsdp2": "fully_shard", "fsdp1": "fsdp1", "replicate_fsdp": "replicate_fsdp", "own": "own",
      "hsdp": "fully_shard", "fsdp1_hybrid": "fsdp1",
      "spmd_shard": "fully_shard", "spmd_replicate": "fully_shard", "spmd_hsdp": "fully_shard"}
# What the names of the forms large models train with set beside the entry point
# (TrainCase.fsdp1_strategy, TrainCase.dp_mesh_dims); "hsdp" and "fsdp1_hybrid" are fsdp2 and
# fsdp1 on a 3-D mesh, whose 2-D DP mesh FSDP1 takes only with a hybrid strategy.
DP_FORMS = {"fsdp1_hybrid": {"fsdp1_strategy": "HYBRID_SHARD"}, "spmd_shard": {"dp_mesh_dims": "shard"},
            "spmd_replicate": {"dp_mesh_dims": "replicate"}, "spmd_hsdp": {"dp_mesh_dims": "both"}}
ON_3D_ONLY = ("hsdp", "fsdp1_hybrid", "spmd_hsdp")  # names that need a (dp_replicate, dp_shard, tp) mesh
ON_3D_TOO = ("fsdp2", "fsdp1", "own", "spmd_shard", "spmd_replicate")  # names that take either mesh
# The SPMD form with no DP wrapper at all: parameters Replicate() on the dp dims, the batch
# sharded on them, and DTensor's own program reduces the gradients over dp (the oracle
# fully_shard's dp_mesh_dims is held to, tpdp_verify.oracles.plain_ddp). Drawn where a
# batch-sharded DTensor is what is judged (the losses), always with dp_mesh_dims="replicate".
DTENSOR = "dtensor"
DDP_ENTRIES = ("ddp_mesh", "transform_ddp", "replicate")  # those that take DDPOptions
FSDP2_ENTRIES = ("fully_shard", "replicate_fsdp")  # those that take FSDP2Options
# Those that take a 2-D DP mesh (HSDP: replicated over its first dimension, sharded over its
# second), on a 3-D (dp_replicate, dp_shard, tp) mesh as torchtitan builds it.
HSDP_ENTRIES = ("fsdp1", "fully_shard", "replicate_fsdp")
MESH_DIMS = ("dp", "tp")
HSDP_MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
# FSDP1's hybrid sharding strategies, the ones a 2-D DP mesh takes, and those of a 1-D one
# (its ZeRO stages: parameters, gradients and optimizer state sharded; gradients and state; none)
FSDP1_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
FSDP1_FLAT = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
# How FSDP2 sees the mesh (TrainCase.dp_mesh_dims): "" a DP sub-mesh, as every entry point
# takes it; else the whole SPMD mesh with DataParallelMeshDims naming its dp dimensions:
# "shard" (FSDP over them), "replicate" (DDP-like over them: the one form FSDP2's replicate
# takes), "both" (HSDP: replicated over dp_replicate, sharded over dp_shard; 3-D meshes only).
SPMD_FORMS = ("shard", "replicate", "both")
# How the loss a run backpropagates reduces its samples' weighted losses, as users write it
# (TrainCase.loss_reduction): "" their mean; "sum"; "sum_over_count", the sum divided by the
# global batch's count; "masked", as a per-token loss with padding is reduced, a row a token:
# some rows are padding (a drawn mask, the first row kept), and the kept rows' sum is divided
# by their count over the global batch, which DTensor counts from the mask (a data-dependent
# reduction over dp). Over a DTensor sharded on dp these reduce the global batch, so only
# the SPMD form draws the last three: under a sub-mesh DP each rank reduces its own rows.
LOSS_REDUCTIONS = ("", "sum", "sum_over_count", "masked")
OPTIMIZERS = ("sgd", "adam")
TRAIN_DTYPES = ("float32", "bfloat16", "float16")
# When the optimizer is built: on the TP'd model before the DP wrapper, on the wrapper's
# parameters, or on the wrapper's parameters after a first (discarded) forward.
BUILT = ("after_wrap", "before_wrap", "after_forward")


@dataclass(frozen=True)
class Size:
    """A model's dimensions; its repr is constructor code."""

    dim: int = 8  # model width
    hidden: int = 12  # feed-forward width; need not be a multiple of the TP degree
    heads: int = 2  # attention heads; a multiple of the TP degree for attention models
    vocab: int = 16
    seq: int = 4


def empty_shard(n: int, tp: int) -> bool:
    """Whether torch.chunk's split of ``n`` rows over ``tp`` ranks (ceil(n / tp) each)
    leaves some rank no row."""
    return -(-n // tp) * (tp - 1) >= n



# DDP's built-in communication hooks (torch.distributed.algorithms.ddp_comm_hooks.default_hooks);
# the compressing ones round every gradient to half precision on the wire.
COMM_HOOKS = ("allreduce", "fp16_compress", "bf16_compress")
HALF = ("bfloat16", "float16")  # the compute dtypes a mixed-precision option draws


def _shown(obj, late: tuple[str, ...], default) -> list[str]:
    """The fields a repr shows: every one but the ``late`` at their ``default`` (one value
    for all, or a dict of each one's)."""
    defaults = default if isinstance(default, dict) else dict.fromkeys(late, default)
    return [f.name for f in fields(obj) if f.repr] + [n for n in late if getattr(obj, n) != defaults[n]]


def _repr(obj, late: tuple[str, ...], default) -> str:
    """Constructor code, with the ``late`` fields (added after cases were recorded) only
    where not ``default``: a case without them reads as it always has (the shipped
    baseline's and cover cases' reprs)."""
    shown = _shown(obj, late, default)
    return f"{type(obj).__name__}({', '.join(f'{n}={getattr(obj, n)!r}' for n in shown)})"


@dataclass(frozen=True)
class DDPOptions:
    """Keyword arguments of DistributedDataParallel (and replicate) a case sets, and the
    communication hook it registers; each default is DDP's own."""

    bucket_cap_mb: float | None = None  # tiny values split the gradients over several buckets
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    find_unused_parameters: bool = False
    sync_buffers: bool = True  # broadcast buffers from the dp group's first rank each forward
    init_sync: bool = True  # broadcast parameters and buffers from the dp group's first rank at wrap time
    skip_all_reduce_unused_params: bool = False
    bucket_cap_mb_list: tuple[float, ...] | None = None  # a cap per bucket, in bucket order
    batched_grad_copy: bool = False
    mixed_precision: str | None = None  # DDP's _MixedPrecision: params in this dtype in forward/backward
    comm_hook: str | None = None  # one of COMM_HOOKS, registered right after wrapping

    def kwargs(self) -> dict:
        """The keywords DDP takes; the newer ones only where set, so that a torch without
        them still takes a case that leaves them at their default."""
        out = {k: getattr(self, k) for k in ("gradient_as_bucket_view", "static_graph", "find_unused_parameters")}
        out[_sync_buffers_name()] = self.sync_buffers
        if self.bucket_cap_mb is not None:
            out["bucket_cap_mb"] = self.bucket_cap_mb
        if self.bucket_cap_mb_list is not None:
            out["bucket_cap_mb_list"] = list(self.bucket_cap_mb_list)
        out |= {k: True for k in ("skip_all_reduce_unused_params", "batched_grad_copy") if getattr(self, k)}
        out |= {} if self.init_sync else {"init_sync": False}
        if self.mixed_precision is not None:
            import torch
            from torch.nn.parallel.distributed import _MixedPrecision

            dtype = getattr(torch, self.mixed_precision)
            out["mixed_precision"] = _MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
        return out

    @property
    def wire_dtype(self) -> str | None:
        """The half dtype every gradient passes through, where an option rounds it to one."""
        return {"fp16_compress": "float16", "bf16_compress": "bfloat16"}.get(self.comm_hook) or self.mixed_precision


@functools.cache  # read from torch when first needed: a case imports no torch.distributed
def _sync_buffers_name() -> str:
    """torch 2.13 renamed DDP's ``broadcast_buffers`` (now deprecated, with a warning)."""
    return "forward_sync_buffers" if "forward_sync_buffers" in ddp_keywords() else "broadcast_buffers"


@functools.cache
def ddp_keywords() -> frozenset[str]:
    """The keywords the installed torch's DistributedDataParallel takes."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    return frozenset(inspect.signature(DistributedDataParallel.__init__).parameters)


@dataclass(frozen=True)
class FSDP2Options:
    """Keyword arguments of fully_shard (and the FSDP2-based replicate) a case sets."""

    reshard_after_forward: bool = True  # fully_shard only: free the unsharded parameters after forward
    mixed_precision: str | None = None  # MixedPrecisionPolicy(param_dtype=this, reduce_dtype=float32)
    # fully_shard only: its shard_placement_fn shards each parameter on this dim where it
    # splits evenly over the shard ranks (torch requires it off dim 0), else on dim 0
    shard_dim: int = field(default=0, repr=False)

    def __repr__(self) -> str:
        return _repr(self, late=("shard_dim",), default=0)

    def kwargs(self, entry: str) -> dict:
        out = {"reshard_after_forward": self.reshard_after_forward} if entry == "fully_shard" else {}
        if self.mixed_precision is not None:
            import torch
            from torch.distributed.fsdp import MixedPrecisionPolicy

            out["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, self.mixed_precision),
                                                    reduce_dtype=torch.float32)
        return out

    @property
    def wire_dtype(self) -> str | None:
        return self.mixed_precision


@dataclass(frozen=True)
class FSDP1Options:
    """Keyword arguments of FullyShardedDataParallel a case sets beside its sharding strategy."""

    # auto_wrap_policy: each of the root's children that holds parameters an FSDP unit of its
    # own (as ModuleWrapPolicy wraps a transformer's blocks), each flattened apart
    auto_wrap: bool = False
    mixed_precision: str | None = None  # MixedPrecision(param_dtype=this, reduce_dtype=float32)

    def kwargs(self, model) -> dict:
        import torch
        from torch.distributed.fsdp import MixedPrecision
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

        out = {}
        if self.auto_wrap:
            units = {id(m) for m in model.children() if any(True for _ in m.parameters())}
            out["auto_wrap_policy"] = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in units)
        if self.mixed_precision is not None:
            out["mixed_precision"] = MixedPrecision(param_dtype=getattr(torch, self.mixed_precision),
                                                    reduce_dtype=torch.float32)
        return out

    @property
    def wire_dtype(self) -> str | None:
        return self.mixed_precision


# How a user clips by the total gradient norm: in one call, or as torchtitan does, the norm
# first (get_total_norm, its full_tensor() where a DTensor), then clip_grads_with_norm_.
CLIP_BY = ("clip_grad_norm_", "get_total_norm")
# The norm clipping takes (norm_type, as float() reads it: a case's repr must evaluate, and
# inf's does not): the 2-norm, the max norm, the 1-norm. Each is a reduction of its own over
# a DTensor's shards (max for inf, sums of |g|^p else).
NORM_TYPES = ("2", "inf", "1")


@dataclass(frozen=True)
class Habits:
    """What users do around the DP wrapper while they train, drawn as part of a case."""

    clip: float | None = None  # clip the model's parameters' gradients to this total norm before each step
    checkpoint: bool = False  # activation checkpointing of every block (torch's composable checkpoint)
    # between steps: "eval" (eval(), a no_grad forward, train()), "no_grad" (a forward), or
    # "submodule" (the model's last block called directly under no_grad, as a user probes it)
    between: str = ""
    set_to_none: bool = True  # zero_grad(set_to_none=...) after each step
    # the model's first child left out of DP (its ignore list): "frozen" by the user, or
    # "trained" with its gradients averaged over dp by the user, after the last backward
    ignored: str = ""
    clip_by: str = field(default=CLIP_BY[0], repr=False)  # one of CLIP_BY (in repr where not the first)
    norm_type: str = field(default=NORM_TYPES[0], repr=False)  # one of NORM_TYPES (in repr where not 2)
    buffers: str = field(default="", repr=False)  # one of BUFFERS (in repr where set)

    def __repr__(self) -> str:
        return _repr(self, late=("clip_by", "norm_type", "buffers"),
                     default={"clip_by": CLIP_BY[0], "norm_type": NORM_TYPES[0], "buffers": ""})


# Losses over a vocabulary head's logits, as users write them (tpdp_verify.fixtures.losses):
# cross entropy, and losses composed of log_softmax or logsumexp of the logits;
# torch computes each over vocab-sharded logits with code of its own under loss_parallel().
LOSS_KINDS = (
    "cross_entropy",    # F.cross_entropy with the case's options
    "target_logprobs",  # each target's log-probability (log_softmax, nll_loss) weighted by a token's weight
    "teacher_kl",       # KL divergence to a fixed teacher distribution (log_softmax, kl_div)
    "z_loss",           # cross entropy plus a penalty on the log-partition (logsumexp) squared
    "nll",              # F.nll_loss over log_softmax, with cross entropy's options but label smoothing
)
# A loss the edge cover cases alone take (properties/losses.py EDGES), never drawn: the
# fixed draws stay as the shipped memo answers them
EDGE_LOSS_KINDS = (
    "expected_cost",    # cross entropy plus the softmax's expected cost, a fixed cost per vocabulary entry
)
REDUCTIONS = ("mean", "sum", "none")  # over a sample's tokens; "none": the per-token losses, then their mean
# How cross entropy takes a sample's logits: "" as (tokens, vocab); "ncd" with the class dim
# first, (N, C, D) = (1, vocab, tokens); "nchw" as a per-pixel classifier's (N, C, H, W), the
# tokens a grid. Under loss_parallel each goes through other branches of its ops (nll_loss2d).
LOGITS = ("", "ncd", "nchw")
LOSS_MODELS = ("tied", "llama_lm", "lm_head")  # the zoo's models with a vocabulary head
# What one call of the loss reduces: "" each sample's tokens (the harness then weights the
# samples, tpdp_verify.ranks.loop.weighted_loss); "batch" every token of the batch at once,
# as users of the SPMD form write it, their logits and targets DTensors sharded on the batch
# over dp: torch reduces over the dp ranks itself (the valid tokens' count, the class
# weights' sum), with some dp rank's samples all padding where targets are ignored.
# Drawn where the batch is a DTensor (the SPMD form): elsewhere each rank's mean is its own.
OVER = ("", "batch")


@dataclass(frozen=True)
class Loss:
    """The loss a case trains with, in place of its model's own; its repr is constructor code."""

    kind: str = "cross_entropy"     # one of LOSS_KINDS, or EDGE_LOSS_KINDS
    reduction: str = "mean"         # one of REDUCTIONS: torch's own reduction over a sample's tokens
    ignore_index: bool = False      # some targets are padding (-100), left out of the loss
    label_smoothing: float = 0.0    # cross entropy's
    class_weights: bool = False     # cross entropy's weight: a fixed weight per vocabulary entry
    parallel: bool = True           # under loss_parallel(): the logits a vocab-sharded DTensor
    logits: str = field(default="", repr=False)  # one of LOGITS (in repr where set)
    over: str = field(default="", repr=False)    # one of OVER (in repr where set)

    def __repr__(self) -> str:
        return _repr(self, late=("logits", "over"), default="")


BETWEEN = ("", "eval", "no_grad", "submodule")
# How the model holds its buffers after TP (Habits.buffers): "" as built; "dtensor" each a
# DTensor replicated over tp, as torchtitan holds its RoPE cache (the model reads their local
# values); "sharded" in the SPMD form (TrainCase.dp_mesh_dims), where DTensor's own program
# meets them: each buffer of a dim or more sharded on its first dim over tp (a per-feature
# table split as the features are), replicated over dp. The cover cases of
# entry_points_train_like_one_device set them on the buffers model (BUFFERED), whose forward
# reads them.
BUFFERS = ("", "dtensor", "sharded")
BUFFERED = ("buffers",)
IGNORED = ("frozen", "trained")

# Meshes a user can cross, which the entry points must refuse or train through exactly:
# DP over the tp dimension or over the whole 2-D mesh, DDP or FSDP1 given the dp process group
# in place of the mesh (so no TP transform or DTensor extension runs), TP over the dp dimension.
MISWIRINGS = {  # each, in a user's words
    "dp_over_tp": "DP given mesh['tp'] in place of mesh['dp']",
    "dp_over_mesh": "DP given the whole (dp, tp) mesh in place of mesh['dp']",
    "dp_by_group": "DDP or FSDP1 given mesh['dp']'s process group in place of the mesh",
    "tp_over_dp": "TP applied over mesh['dp'] in place of mesh['tp']",
}


# TrainCase's fields added late, in its repr where set (not their falsy default)
_LATE = ("fsdp1_strategy", "dp_mesh_dims", "loss_reduction", "batch_short")


def _unravel(index: int, shape: tuple[int, ...]) -> list[int]:
    """``index``'s coordinates in ``shape``, row-major."""
    at = []
    for size in reversed(shape):
        index, place = divmod(index, size)
        at.append(place)
    return at[::-1]


@dataclass(frozen=True)
class TrainCase:
    """One TP+DP training run and the single-device run it must match."""

    model: str = "mlp"                  # a name in tpdp_verify.fixtures.ZOO
    size: Size = field(default_factory=Size)
    mesh_shape: tuple[int, ...] = (1, 2)  # (dp, tp), or (dp_replicate, dp_shard, tp) for HSDP_ENTRIES
    entry: str = "ddp_mesh"
    ddp: DDPOptions = field(default_factory=DDPOptions)
    fsdp: FSDP2Options = field(default_factory=FSDP2Options)
    habits: Habits = field(default_factory=Habits)
    optimizer: str = "sgd"
    built: str = "after_wrap"
    eval_first: bool = False            # a no_grad eval forward before training
    steps: int = 1                      # optimizer steps
    accumulate: int = 1                 # microbatches a step; all but the last under no_sync
    local_batch: int = 2                # samples a dp rank gets per microbatch
    seed: int = 0
    dtype: str = "float32"              # of parameters and data: float32, bfloat16 or float16
    wiring: str = ""                    # "" (as documented) or a key of MISWIRINGS
    loss: Loss | None = field(default=None, repr=False)  # None: the model's own (in repr where set)
    # FSDP1's sharding strategy (a name in FSDP1_HYBRID or FSDP1_FLAT; "" its default, FULL_SHARD), and how
    # FSDP2 sees the mesh (SPMD_FORMS; "" a sub-mesh): in repr where set
    fsdp1_strategy: str = field(default="", repr=False)
    dp_mesh_dims: str = field(default="", repr=False)
    loss_reduction: str = field(default="", repr=False)  # one of LOSS_REDUCTIONS (in repr where set)
    # The SPMD form alone: rows the global batch lacks of dp x local_batch, so that it does not
    # divide over the dp dims and DTensor's Shard(0) on each leaves ranks short or empty (rows)
    batch_short: int = field(default=0, repr=False)
    fsdp1: FSDP1Options = field(default_factory=FSDP1Options, repr=False)  # in repr where set
    # A user's model, plan, data and loss (tpdp_verify.plan.case.UserModel) in place of a zoo
    # model; its replay is the verify_plan call or the CLI command, not this repr.
    user: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.batch_short and not (self.dp_mesh_dims and 0 < self.batch_short < self.dp * self.local_batch):
            raise ValueError(f"batch_short={self.batch_short} needs the SPMD form (dp_mesh_dims) and a row left of "
                             f"the {self.dp} x {self.local_batch} rows")

    def _repr_pretty_(self, p, cycle) -> None:
        """How hypothesis prints a case: as repr does, without the user's model (hypothesis
        prints every field of a dataclass otherwise)."""
        from tpdp_verify.hypothesis_internals import pprint_fields

        pprint_fields(self, p, cycle, self._shown())

    def _shown(self) -> list[str]:
        return (_shown(self, ("loss",), None) + [n for n in _LATE if getattr(self, n)]
                + (["fsdp1"] if self.fsdp1 != FSDP1Options() else []))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self._shown())})"

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def wire_dtype(self):
        """The lowest precision a value passes through on the way: a half-precision option's
        dtype, or the case's own (the floor of every bound, tpdp_verify.judging.tolerance)."""
        import torch

        half = self.ddp.wire_dtype if self.entry in DDP_ENTRIES else \
            self.fsdp.wire_dtype if self.entry in FSDP2_ENTRIES else \
            self.fsdp1.wire_dtype if self.entry == "fsdp1" else None
        dtypes = [self.torch_dtype] + ([getattr(torch, half)] if half else [])
        return max(dtypes, key=lambda d: torch.finfo(d).eps)

    @property
    def region(self) -> str | None:
        """Where a case with a drawn loss lies, as a baseline tells faults apart: the loss's
        path through torch, its kind under loss_parallel or not (eight regions); entry
        points, models and meshes are the other training properties' regions. None for a case without one (tpdp_verify.runner.property.region:
        entry point, model, mesh kind)."""
        if self.loss is None:
            return None
        return f"{self.loss.kind}{' under loss_parallel' if self.loss.parallel else ''}"

    @property
    def dp_form(self) -> str:
        """The entry point as a region names it: with FSDP1's strategy, how fully_shard sees
        the mesh, or the miswiring it is given, where the case sets one (FSDP1 given the dp
        group fails as FSDP1 given the whole mesh does, and each is a fault of its own)."""
        form = f"{self.entry}(dp_mesh_dims={self.dp_mesh_dims})" if self.dp_mesh_dims else self.entry
        form = f"{form}({self.fsdp1_strategy})" if self.fsdp1_strategy else form
        return f"{form}[{self.wiring}]" if self.wiring else form

    @property
    def mesh_dims(self) -> tuple[str, ...]:
        return HSDP_MESH_DIMS if len(self.mesh_shape) == 3 else MESH_DIMS

    @property
    def dp_dims(self) -> tuple[str, ...]:
        """The mesh's data-parallel dimensions: ("dp",), or ("dp_replicate", "dp_shard")."""
        return self.mesh_dims[:-1]

    @property
    def dp(self) -> int:
        """The data-parallel degree: every dp dimension's size multiplied."""
        return math.prod(self.mesh_shape[:-1])

    @property
    def tp(self) -> int:
        return self.mesh_shape[-1]

    @property
    def global_batch(self) -> int:
        return self.dp * self.local_batch - self.batch_short

    def rows(self, dp_rank: int) -> slice:
        """The rows of the global batch the dp rank ``dp_rank`` (row-major over the dp dims,
        dp_replicate outer) takes: local_batch each, or, with batch_short, as DTensor's
        Shard(0) on each dp dim in turn splits them, by torch.chunk's contract (blocks of the
        rounded-up share, the last ones short or empty), the outer dim first."""
        if not self.batch_short:
            return slice(dp_rank * self.local_batch, (dp_rank + 1) * self.local_batch)
        lo, hi = 0, self.global_batch
        for size, place in zip(self.mesh_shape[:-1], _unravel(dp_rank, self.mesh_shape[:-1])):
            block = -(-(hi - lo) // size)
            lo, hi = min(lo + place * block, hi), min(lo + (place + 1) * block, hi)
        return slice(lo, hi)

    @property
    def loss_shared(self) -> bool:
        """Each dp group's loss is its share of the step's (a sum over the global count, its DP
        summing gradients: verify_plan's loss_share), so the step's loss sums them; the SPMD
        form's loss is already the step's, a DTensor reduced over dp."""
        return self.loss_reduction == "sum_over_count" and not self.dp_mesh_dims
