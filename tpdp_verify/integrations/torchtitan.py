"""torchtitan's own parallelize, run as its trainer runs it, as parallelize functions for
``verify_plan(..., parallelize_fn=..., dp="own")`` (and for a DP of tpdp-verify's choosing).

torchtitan 0.3.0 declares each module's sharding on its config (``set_llama3_sharding_config``)
and applies it with ``Module.parallelize(ParallelDims)``; ``parallelize_llama`` does that, then
its own FSDP2 (``apply_fsdp_to_decoder``: each block, then the root, the gradient divide
factor 1.0, since its loss is each rank's sum over the step's global count of valid tokens).
The functions here call those on the ranks:

- ``parallelize``: torchtitan's TP alone (``model.parallelize``), for a DP tpdp-verify wraps;
- ``parallelize_llama``: the whole ``parallelize_llama``, TP then its FSDP2 (HSDP on a 3-D
  mesh), for ``dp="own"``;
- ``dp_alone``: its FSDP2 step alone, on the same dp groups: the plain-DP comparison;
- ``llama3_full_dtensor``, ``parallelize_llama_full_dtensor``, ``dp_alone_full_dtensor``: the
  same under its full_dtensor backend (every parameter a DTensor on its dense mesh).

The one thing made here is torchtitan's ``ParallelDims`` for the harness's mesh, built by
torchtitan's own ``build_mesh`` once per rank process and checked to hold the harness's tp
groups. Two things differ from a GPU run (docs/user-guide.md says them too):

- torchtitan picks its device as "cuda" wherever no accelerator is found; on a CPU its
  meshes are built on "cpu";
- gloo has no ``PREMUL_SUM``, which FSDP2 reduces with for a divide factor that is not the dp
  size (torchtitan's 1.0): there FSDP2 is told to reduce with ``SUM`` and divide after
  (``set_force_sum_reduction_for_comms``), by a factor of 1.0, the same sum.

The model (``llama3``) is torchtitan's Llama 3 in small, built from torchtitan's own config
builder: fused qkv, GQA, complex RoPE cache, SwiGLU, RMSNorm. Its inner attention is
torchtitan's SDPA module, since FlexAttention has no backward on the CPU. The loss is
torchtitan's ``CrossEntropyLoss`` divided by the step's global count of valid tokens
(``loss``, with ``verify_plan(loss_share=True)``: each rank's share, summed over dp), or by
the batch's own count (``mean_loss``, for a DP that averages).

Imported on the ranks only; the core never imports this module.
"""

from __future__ import annotations

import torch
from torch import nn

from tpdp_verify.errors import UsageError

# the sizes of the small Llama 3: heads and kv heads divisible by tp 2, the hidden width by 4
DIM, HEADS, KV_HEADS, HIDDEN, VOCAB, LAYERS, SEQUENCE = 16, 4, 2, 32, 32, 2, 8
IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX
# ParallelismConfig.spmd_backend: DTensor on the model-parallel axes, its FSDP2 on the dp
# submesh (partial_dtensor), or every parameter a DTensor on its whole dense mesh, its FSDP2
# given that mesh with dp_mesh_dims, the batch split on it as full_dtensor.parallelize_inputs
# splits it (FULL: the harness reads that mesh from the FSDP2 units, entries.spmd_batch). The
# third, spmd_types (its default), is not driven: its parameters are plain local shards under
# its SpmdContext, and its FSDP2 needs a fully_shard that takes spmd_types parameters (torch
# 2.15 has it; 2.13 raises "all parameters must be DTensors on the full SPMD mesh").
BACKEND, FULL = "partial_dtensor", "full_dtensor"
_dims: dict[tuple, object] = {}  # per rank process: each ParallelDims built once, as the trainer builds one


def require() -> None:
    """One line naming what is missing, where torchtitan cannot be imported."""
    missing = []
    for module in ("torchtitan", "spmd_types", "tyro", "torchdata"):
        try:
            __import__(module)
        except ImportError as exc:
            missing.append(f"{module} ({exc})")
    if missing:
        raise UsageError(f"torchtitan is not importable here: missing {', '.join(missing)}; install the "
                         "extra with the pinned torch: pip install -c constraints.txt -e '.[torchtitan]'")


def config(sequence_parallel: bool = True, backend: str = BACKEND):
    """torchtitan's Llama 3 config in small, its sharding declared as its trainer declares it
    for ``backend``."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    layers = _build_llama3_layers(n_layers=LAYERS, dim=DIM, n_heads=HEADS, n_kv_heads=KV_HEADS, hidden_dim=HIDDEN,
                                  rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=4 * SEQUENCE, theta=10000.0),
                                  attn_backend="flex")
    for layer in layers:  # FlexAttention has no backward on the CPU; torchtitan's SDPA module in its place
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = Llama3Model.Config(dim=DIM, vocab_size=VOCAB, layers=layers,
                               tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
                               norm=RMSNorm.Config(normalized_shape=DIM),
                               lm_head=Linear.Config(in_features=DIM, out_features=VOCAB))

    class Trainer:  # what update_from_config reads of a trainer's config
        parallelism = ParallelismConfig(spmd_backend=backend, enable_sequence_parallel=sequence_parallel)

    model.update_from_config(config=Trainer())
    return model


def llama3(backend: str = BACKEND) -> nn.Module:
    """torchtitan's Llama 3 in small (``config()``), its states initialised by torchtitan
    (``init_states``) from torch's global generator."""
    require()
    model = config(backend=backend).build()
    model.init_states()
    return model


def llama3_full_dtensor() -> nn.Module:
    """The small Llama 3 with its sharding declared for the full_dtensor backend."""
    return llama3(FULL)


def tokens(n: int, generator: torch.Generator) -> dict:
    """``n`` sequences and their next-token labels, the last position ignored (as a shifted
    dataset leaves it), and the step's count of valid labels over all ``n`` rows in each row
    (what torchtitan's trainer sums over the batch mesh)."""
    sequence = torch.randint(0, VOCAB, (n, SEQUENCE + 1), generator=generator)
    labels = sequence[:, 1:].clone()
    labels[:, -1] = IGNORE_INDEX
    valid = (labels != IGNORE_INDEX).sum()
    return {"input": sequence[:, :-1], "labels": labels, "valid_tokens": valid.repeat(n)}


def _loss_fn():
    from torchtitan.components.loss import CrossEntropyLoss

    return CrossEntropyLoss.Config(global_vocab_size=VOCAB).build()


def loss(output, batch: dict) -> torch.Tensor:
    """torchtitan's trainer's loss: the batch's summed cross entropy over the step's global
    count of valid tokens; each rank's share of the step's loss (``verify_plan(loss_share=True)``)."""
    value, _ = _loss_fn()(output, batch["labels"], batch["valid_tokens"][0])
    return value


def mean_loss(output, batch: dict) -> torch.Tensor:
    """torchtitan's loss over the batch's own count of valid tokens: its mean, for a DP that
    averages gradients (DDP, tpdp-verify's FSDP2)."""
    value, _ = _loss_fn()(output, batch["labels"], (batch["labels"] != IGNORE_INDEX).sum())
    return value


def parallel_dims(mesh, backend: str = BACKEND):
    """torchtitan's ParallelDims for the harness's (dp, tp) or (dp_replicate, dp_shard, tp)
    mesh, its meshes built by its ``build_mesh`` (once per rank process) and checked to hold
    the harness's tp groups."""
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as titan
    from torchtitan.distributed import utils

    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    replicas, shards, tp_ranks = sizes.get("dp_replicate", 1), sizes.get("dp_shard", sizes.get("dp", 1)), sizes["tp"]
    key = (replicas, shards, tp_ranks, backend)
    if key not in _dims:
        if titan.device_type == "cuda" and not torch.cuda.is_available():
            titan.device_type = "cpu"  # torchtitan's default where it finds no accelerator
        dims = titan.ParallelDims(dp_replicate=replicas, dp_shard=shards, cp=1, tp=tp_ranks, pp=1, ep=1,
                                  world_size=dist.get_world_size(), spmd_backend=backend)
        dims.build_mesh()
        if dims.get_mesh("tp").mesh.tolist() != mesh["tp"].mesh.tolist():
            raise RuntimeError(f"torchtitan's tp mesh {dims.get_mesh('tp')} is not the harness's {mesh['tp']}")
        _dims[key] = dims
    utils.set_spmd_backend(backend)  # the trainer sets it before it builds the model
    return _dims[key]


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """torchtitan's TP alone: ``model.parallelize(ParallelDims)``, the sharding its config
    declares, on the harness's mesh; DP is the harness's (``verify_plan(dp=...)``)."""
    model.parallelize(parallel_dims(mesh))
    return model


def parallelize_llama(model: nn.Module, mesh, backend: str = BACKEND) -> nn.Module:
    """torchtitan's whole ``parallelize_llama``: TP, then its FSDP2 over the dp dims (HSDP on a
    3-D mesh), float32 throughout (``mixed_precision_param``), as its trainer calls it."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.models.llama3 import parallelize_llama as titans

    dims = parallel_dims(mesh, backend)
    model = titans(model, parallel_dims=dims, training=TrainingConfig(mixed_precision_param="float32"),
                   parallelism=ParallelismConfig(tensor_parallel_degree=dims.tp, spmd_backend=backend,
                                                 data_parallel_shard_degree=dims.dp_shard,
                                                 data_parallel_replicate_degree=dims.dp_replicate),
                   compile_config=CompileConfig(), ac_config=None, dump_folder="")
    return _summed_on_gloo(model)


def parallelize_llama_full_dtensor(model: nn.Module, mesh) -> nn.Module:
    """``parallelize_llama`` under the full_dtensor backend: every parameter a DTensor on
    torchtitan's dense mesh (dp_replicate, dp_shard, tp), its FSDP2 given that mesh with
    ``dp_mesh_dims``; the batch is split on that mesh, and the loss is the step's whole (no
    ``loss_share``): the output is a DTensor of the global batch."""
    return parallelize_llama(model, mesh, FULL)


def dp_alone(model: nn.Module, mesh, backend: str = BACKEND) -> nn.Module:
    """torchtitan's FSDP2 step of ``parallelize_llama`` alone (``apply_fsdp_to_decoder`` with its
    divide factor), on the same dp groups, no TP: the plain-DP comparison."""
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    dims = parallel_dims(mesh, backend)
    shards = "fsdp" if backend == BACKEND else "dp_shard"  # full_dtensor's meshes name no fsdp submesh
    names = ["dp_replicate", shards] if dims.dp_replicate_enabled else [shards]
    apply_fsdp_to_decoder(model, dims.get_mesh(names), param_dtype=torch.float32, reduce_dtype=torch.float32,
                          pp_enabled=False, cpu_offload=False, reshard_after_forward_policy="default")
    return _summed_on_gloo(model)


def dp_alone_full_dtensor(model: nn.Module, mesh) -> nn.Module:
    """``dp_alone`` on the full_dtensor backend's dp groups: its FSDP2 on the dp submesh of its
    dense mesh (a model without TP holds no DTensor for dp_mesh_dims to take)."""
    return dp_alone(model, mesh, FULL)


def _summed_on_gloo(model: nn.Module) -> nn.Module:
    """On gloo, each FSDP2 module reduces with SUM and divides after: gloo has no PREMUL_SUM,
    which FSDP2 picks for a divide factor that is not the dp size (torchtitan's 1.0)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    if dist.get_backend() == "gloo":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model
