"""A user's models, plans and data for tests/test_plan.py: module level, so ranks import them."""

import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


class MLP(nn.Module):
    def __init__(self, width: int = 8, hidden: int = 16):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.act = nn.ReLU()
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


class Blocks(nn.Module):
    """Plan keys several levels deep, reached by a wildcard."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(MLP() for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def make_mlp():
    return MLP()


@dataclasses.dataclass(frozen=True)
class MLPOf:
    """model_fn as a callable object, as a table of models builds one per entry
    (tpdp_verify.integrations.conformance.Tiny): sent to the ranks and replayed by its repr."""

    kind: str = "mlp"

    def __call__(self):
        return MLP()


class Outputs(MLP):
    """An MLP returning a pytree, its input by keyword: what a transformers-style model does."""

    def forward(self, x, scale=None):
        out = self.down(self.act(self.up(x))) * scale
        return {"logits": out, "aux": (out.sum(-1), out.mean()), "steps": 1}


def make_outputs():
    return Outputs()


def keyword_vectors(n, generator):
    return {"x": torch.randn(n, 8, generator=generator), "scale": torch.rand(n, 1, generator=generator) + 0.5}


def keyword_vector_and_constant(n, generator):
    """A forward's argument the same for every sample (a float), given whole to every rank."""
    return {"x": torch.randn(n, 8, generator=generator), "scale": 2.0}


def keyword_vector_and_list(n, generator):
    return {"x": torch.randn(n, 8, generator=generator), "scale": [2.0]}


def make_blocks():
    return Blocks()


def make_narrow():
    return MLP(hidden=1)


def make_per_rank():
    """Weights seeded by the rank: the mistake the checksums catch."""
    torch.manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    return MLP()


PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}
BLOCKS_PLAN = {"layers.*.up": ColwiseParallel(), "layers.*.down": RowwiseParallel()}
SWAPPED = {"up": RowwiseParallel(), "down": ColwiseParallel()}
ATTENTION = {f"layers.*.attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")} | {
    "layers.*.attention.wo": RowwiseParallel()}  # row- and column-parallel swapped
TYPO = {"upp": ColwiseParallel(), "down": RowwiseParallel()}
LOCAL_HEAD = {"down": ColwiseParallel()}  # the head hands on its tp shard: the model returns half its width
WRONG_TYPE = {"act": ColwiseParallel(), "down": RowwiseParallel()}
PARTIAL = {"layers.*.up": ColwiseParallel(), "layers.0.down": RowwiseParallel(), "layers.1.dwn": RowwiseParallel()}


def plan_of_mesh(tp_mesh):
    return dict(PLAN)


def vectors(n, generator):
    return torch.randn(n, 8, generator=generator)


def with_targets(n, generator):
    return {"input": torch.randn(n, 8, generator=generator), "target": torch.randn(n, 8, generator=generator)}


def mse(out, batch):
    return (out - batch["target"]).pow(2).mean(1)


def three_rows(n, generator):
    return torch.randn(3, 8, generator=generator)


def unseeded(n, generator):
    return torch.randn(n, 8)


def unreduced_loss(out, batch):
    return out.pow(2)  # a loss per element, not per sample


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def make_llama():
    """torchtitan's Llama in small (fixtures.models.LlamaLM): vocab 16, width 8, 2 heads, 4 tokens."""
    from tpdp_verify.fixtures.models import LlamaLM

    return LlamaLM(vocab=16, dim=8, hidden=12, heads=2, seq=4)


def tokens(n, generator):
    return torch.randint(0, 16, (n, 4), generator=generator)


def parallelize_swapped(model, mesh):
    """The user's parallelize function with the feed-forward's styles swapped."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh["tp"], SWAPPED)
    return model


def parallelize_with_ddp(model, mesh):
    """The user's own TP, then DDP on the dp dimension: a function that wraps DP itself."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(parallelize_module(model, mesh["tp"], PLAN), device_mesh=mesh["dp"])


def parallelize_nothing(model, mesh):
    return model


def parallelize_raises(model, mesh):
    return model.no_such_submodule


def lm_plan(tp_mesh):
    """torchtitan's full plan: sequence parallel, and a vocab-sharded head for loss_parallel."""
    from tpdp_verify.fixtures import plans

    return plans.llama_lm()


def tokens_and_targets(n, generator):
    x = torch.randint(0, 16, (n, 4), generator=generator)
    return {"input": x, "target": x.roll(-1, 1)}


def dtensor_token_loss(out, batch):
    """Per-sample cross entropy as a user writes it under loss_parallel: a DTensor, kept one."""
    n, seq = batch["target"].shape
    return F.cross_entropy(out.flatten(0, 1), batch["target"].flatten(), reduction="none").view(n, seq).mean(1)


def loss_raising_on_rank_1(out, batch):
    if dist.is_initialized() and dist.get_rank() == 1:
        raise ValueError("the loss broke on rank 1")
    return out.pow(2).mean(1)


class Hangs(MLP):
    """Rank 1 never returns from its forward; rank 0 waits for it in the plan's collective."""

    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:
            time.sleep(3600)
        return super().forward(x)


def make_hanging():
    return Hangs()


class Boom(nn.Module):
    def forward(self, x):
        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("boom on rank 1")
        return x


class Raising(MLP):
    """An MLP whose last module raises on rank 1 only."""

    def __init__(self):
        super().__init__()
        self.boom = Boom()

    def forward(self, x):
        return self.boom(super().forward(x))


def make_raising():
    return Raising()


def make_tied():
    """An embedding tied to its output head (fixtures.models.TiedLM): vocab 16, width 8."""
    from tpdp_verify.fixtures.models import TiedLM

    return TiedLM(vocab=16, dim=8, hidden=12)


def tied_plan_without_retie(tp_mesh):
    """The tied model's plan (fixtures.plans.tied), applied without re-tying the weights after it."""
    from tpdp_verify.fixtures import plans

    return plans.tied()


def parallelize_tied_vocab(model, mesh):
    """The tied model with its vocabulary sharded as loss_parallel wants it: the embedding's
    rows and the head's outputs (Shard(-1) logits, kept a DTensor), then re-tied."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from tpdp_verify.fixtures import plans

    plan = {**plans.tied(), "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    parallelize_module(model, mesh["tp"], plan)
    plans.retie(model)
    return model


class Float32Only(MLP):
    """Trains in float32; its forward casts to float32 by hand, which the float64 run cannot take."""

    def forward(self, x):
        return super().forward(x) @ torch.eye(8)


def make_float32_only():
    return Float32Only()


def parallelize_with_ddp_over_tp(model, mesh):
    """A wiring mistake: TP on mesh['tp'], then DDP over mesh['tp'] as well."""
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(parallelize_module(model, mesh["tp"], PLAN), device_mesh=mesh["tp"])


def parallelize_with_fsdp_over_tp(model, mesh):
    """A wiring mistake: TP on mesh['tp'], then fully_shard over mesh['tp'] as well."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    return fully_shard(parallelize_module(model, mesh["tp"], PLAN), mesh=mesh["tp"])


def parallelize_tp_over_dp(model, mesh):
    """A wiring mistake: TP over mesh['dp']."""
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh["dp"], PLAN)


def _on_the_whole_mesh(model, mesh, divide_by: float | None):
    """The SPMD form torch 2.13 moves DP to, as a user writes it: each parameter a DTensor on
    the whole mesh, Replicate() over the dp dimensions and up/down placed on tp as
    ColwiseParallel/RowwiseParallel place them, then fully_shard over the whole mesh with
    dp_mesh_dims naming the dp dimensions it replicates over."""
    from torch.distributed.fsdp import DataParallelMeshDims, fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dp = tuple(n for n in mesh.mesh_dim_names if n != "tp")
    placed = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)}
    for name, p in list(model.named_parameters()):
        owner, _, attr = name.rpartition(".")
        where = (Replicate(),) * len(dp) + (placed.get(name, Replicate()),)
        setattr(model.get_submodule(owner), attr, nn.Parameter(distribute_tensor(p.detach(), mesh, where)))
    fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate=dp[0] if len(dp) == 1 else dp))
    if divide_by is not None:
        model.set_gradient_divide_factor(divide_by)
    return model


def parallelize_spmd(model, mesh):
    """fully_shard over the whole SPMD mesh as torch 2.13 documents it."""
    return _on_the_whole_mesh(model, mesh, None)


def parallelize_spmd_undivided(model, mesh):
    """The same with the gradient divide factor 1, the workaround of torch 2.13's 1/dp
    (docs/known-divergences.md, fault 17): exact for the replicating form on gloo."""
    return _on_the_whole_mesh(model, mesh, 1.0)


def llama_blocks(tp_mesh):
    """torchtitan's plan for a Llama's blocks: attention and feed-forward, no vocab-sharded head."""
    from tpdp_verify.fixtures import plans

    return plans.llama_block("layers.0.")


def make_fixed_heads_llama():
    """make_llama with a port's mistake: its attention splits the projections into the
    config's head count (``view(n, seq, heads, -1)``) instead of the heads a rank holds. On
    one device the same model; under ColwiseParallel each rank splits its half of the
    columns into all the heads: silently other attention, a plan and model that disagree."""
    import torch.nn.functional as F

    from tpdp_verify.fixtures.models import Attention

    class FixedHeads(Attention):
        def __init__(self, dim, heads, seq):
            super().__init__(dim, heads, seq)
            self.heads = heads

        def forward(self, x):
            n, seq, _ = x.shape
            q, k, v = (w(x).view(n, seq, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(out.transpose(1, 2).reshape(n, seq, -1))

    model = make_llama()
    for layer in model.layers:
        layer.attention = FixedHeads(8, 2, 4)
    return model



def blocks_and_local_head(tp_mesh):
    """llama_blocks, and the vocabulary head ColwiseParallel as written for loss_parallel but
    without it: the head hands on its shard of the vocabulary, and a plain loss indexes past it."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    return llama_blocks(tp_mesh) | {"output": ColwiseParallel()}


def token_loss(out, batch):
    """Per-sample cross entropy over plain logits, as a user writes it without loss_parallel."""
    n, seq = batch["target"].shape
    return F.cross_entropy(out.flatten(0, 1), batch["target"].flatten(), reduction="none").view(n, seq).mean(1)


def blocks_with_colwise_w2(tp_mesh):
    """llama_blocks with the feed-forward's down projection ColwiseParallel, as w1 and w3 are:
    it gets their shard of the hidden features and cannot multiply it."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    return llama_blocks(tp_mesh) | {"layers.0.feed_forward.w2": ColwiseParallel()}
