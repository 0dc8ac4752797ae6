"""A training case: plain, printable, picklable data that every rank and the oracle rebuild.

``repr`` of a case is constructor code, so a shrunk falsifying example replays by pasting it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

# Data-parallel entry points, in the order the strategy shrinks toward.
ENTRIES = (
    "ddp_mesh",         # DistributedDataParallel(model, device_mesh=mesh["dp"])
    "transform_ddp",    # _pre_dp_module_transform(model), then DDP on the dp process group
    "replicate",        # composable replicate(model, device_mesh=mesh["dp"])
    "fsdp1",            # FullyShardedDataParallel(model, device_mesh=mesh["dp"]): DTensorExtensions
    "fully_shard",      # FSDP2 fully_shard(model, mesh=mesh["dp"]): DTensor parameters on the 2-D mesh
)
# verify_plan's names for them (tpdp_verify.plan); "own": the user's parallelize function
# applies DP itself (tpdp_verify.ranks.entries.wrap_own finds which).
DP = {"ddp": "transform_ddp", "ddp_mesh": "ddp_mesh", "replicate": "replicate",
      "fsdp2": "fully_shard", "fsdp1": "fsdp1", "own": "own"}
DDP_ENTRIES = ("ddp_mesh", "transform_ddp", "replicate")  # those that take DDPOptions
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



@dataclass(frozen=True)
class DDPOptions:
    """Keyword arguments of DistributedDataParallel (and replicate) a case sets."""

    bucket_cap_mb: float | None = None  # tiny values split the gradients over several buckets
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    find_unused_parameters: bool = False
    sync_buffers: bool = True  # broadcast buffers from the dp group's first rank each forward

    def kwargs(self) -> dict:
        out = {k: v for k, v in vars(self).items() if k not in ("bucket_cap_mb", "sync_buffers")}
        if self.bucket_cap_mb is not None:
            out["bucket_cap_mb"] = self.bucket_cap_mb
        out[_sync_buffers_name()] = self.sync_buffers
        return out


@functools.cache  # read from torch when first needed: a case imports no torch.distributed
def _sync_buffers_name() -> str:
    """torch 2.13 renamed DDP's ``broadcast_buffers`` (now deprecated, with a warning)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"


@dataclass(frozen=True)
class TrainCase:
    """One TP+DP training run and the single-device run it must match."""

    model: str = "mlp"                  # a name in tpdp_verify.fixtures.ZOO
    size: Size = field(default_factory=Size)
    mesh_shape: tuple[int, int] = (1, 2)  # (dp, tp)
    entry: str = "ddp_mesh"
    ddp: DDPOptions = field(default_factory=DDPOptions)
    optimizer: str = "sgd"
    built: str = "after_wrap"
    eval_first: bool = False            # a no_grad eval forward before training
    steps: int = 1                      # optimizer steps
    accumulate: int = 1                 # microbatches a step; all but the last under no_sync
    local_batch: int = 2                # samples a dp rank gets per microbatch
    seed: int = 0
    dtype: str = "float32"              # of parameters and data: float32, bfloat16 or float16
    # A user's model, plan, data and loss (tpdp_verify.plan.UserModel) in place of a zoo
    # model; its replay is the verify_plan call or the CLI command, not this repr.
    user: object = field(default=None, repr=False)

    def _repr_pretty_(self, p, cycle) -> None:
        """How hypothesis prints a case: as repr does, without the user's model (hypothesis
        prints every field of a dataclass otherwise)."""
        from hypothesis.vendor.pretty import pprint_fields

        pprint_fields(self, p, cycle, [f.name for f in fields(self) if f.repr])

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @property
    def dp(self) -> int:
        return self.mesh_shape[0]

    @property
    def tp(self) -> int:
        return self.mesh_shape[1]

    @property
    def global_batch(self) -> int:
        return self.dp * self.local_batch
