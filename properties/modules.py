"""Hypothesis strategies for module trees: plain, printable, picklable data, built per rank.

A drawn ``TreeCase`` prints as constructor code, so a falsifying example replays by pasting
it (``from tpdp_verify.cases.trees import TreeCase, Node, ParamSpec`` and
``from torch.distributed.tensor import Shard, Replicate``); ``build`` turns it into the same
``nn.Module`` on every rank, DTensor parameters included, as ``parallelize_module`` leaves them.

The trees aim at what the TP+DP transform does with ``named_parameters()`` names: it splits
them at dots, walks ``get_submodule`` and ``delattr``/``setattr``s each parameter. So names
share prefixes ("layer", "layer1", "layer_1"), containers name children "0", "1", and
shared submodules and tied parameters appear under a second name that ``named_parameters``
hides.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import replace
from typing import Iterator

import torch
from hypothesis import strategies as st
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from tpdp_verify.cases.trees import Node, ParamSpec, TreeCase, is_under, join_path, split_path
from tpdp_verify.properties.strategies import mesh_shapes

KINDS = ("module", "sequential", "modulelist", "moduledict")  # simplest first: shrinks to "module"
CALLABLE_KINDS = ("module", "sequential")  # what nn.Sequential.forward can chain

# Families of names that are prefixes of one another, with digits and underscores, so that
# "layer.w" and "layer1.w" or "w" and "w_1" meet at the same level. Simplest first.
NAMES = (
    "l", "layer", "layer1", "layer_1", "layer10", "w", "w1", "w_1", "weight",
    "b", "bias", "bias_", "h0", "h00", "_x", "_x1",
)
DICT_KEYS = NAMES + ("0", "1", "10")  # ModuleDict keys may look like Sequential indices

MAX_PARAMS = 24  # parameters drawn per tree, so a case builds in well under a second
MAX_EXTRA_NODES = 12  # nodes besides the spine that guarantees the drawn depth


_TREE_ATTRS = {"param_names", "buffer_names", "child_names"}  # TreeModule's own attributes


def _safe(name: str, owner: type) -> bool:
    """register_parameter/add_module refuse names that are already attributes."""
    return not hasattr(owner, name) and name not in _TREE_ATTRS


assert all(_safe(n, nn.Module) for n in NAMES), "a name would shadow an nn.Module attribute"
assert all(_safe(k, nn.ModuleDict) for k in DICT_KEYS), "a key would shadow a ModuleDict attribute"


# ---------------------------------------------------------------------------
# Building the module on a rank.
# ---------------------------------------------------------------------------


def _run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Call a child; ModuleList and ModuleDict have no forward, so add up their members."""
    if isinstance(module, nn.ModuleDict):
        module = module.values()
    elif not isinstance(module, nn.ModuleList):
        return module(x)
    return sum((_run(m, x) for m in module), torch.zeros_like(x))


class TreeModule(nn.Module):
    """A "module" node. forward reads everything by attribute name, at call time, because
    the transform under test swaps parameter attributes (Parameter, DTensor, local shard)."""

    def __init__(self, param_names=(), buffer_names=(), child_names=()):
        super().__init__()
        self.param_names = tuple(param_names)
        self.buffer_names = tuple(buffer_names)
        self.child_names = tuple(child_names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x
        for name in self.param_names:
            p = getattr(self, name)
            # full_tensor: the gradient goes back through DTensor autograd to the shard;
            # every rank runs the same forward, so the collectives line up.
            out = out + (p.full_tensor().sum() if isinstance(p, DTensor) else p.sum())
        for name in self.buffer_names:
            out = out + getattr(self, name).sum() * 0
        for name in self.child_names:
            out = out + _run(getattr(self, name), x)
        return out

    def extra_repr(self) -> str:
        return f"params={self.param_names}, buffers={self.buffer_names}"


def _param(spec: ParamSpec, path: str, seed: int, mesh) -> nn.Parameter:
    """The same full tensor on every rank, from the seed and the parameter's own path."""
    gen = torch.Generator().manual_seed(seed + zlib.crc32(path.encode()))
    full = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    if spec.placements is None:
        return nn.Parameter(full, requires_grad=spec.requires_grad)
    return nn.Parameter(distribute_tensor(full, mesh, spec.placements), requires_grad=spec.requires_grad)


def _build(node: Node, path: str, seed: int, mesh) -> nn.Module:
    children = [(name, _build(child, join_path(path, name), seed, mesh)) for name, child in node.children]
    if node.kind == "sequential":
        return nn.Sequential(*(m for _, m in children))
    if node.kind == "modulelist":
        return nn.ModuleList(m for _, m in children)
    if node.kind == "moduledict":
        return nn.ModuleDict(children)
    module = TreeModule([p.name for p in node.params], node.buffers, [n for n, _ in children])
    for spec in node.params:
        setattr(module, spec.name, _param(spec, join_path(path, spec.name), seed, mesh))
    for i, name in enumerate(node.buffers):
        module.register_buffer(name, torch.arange(i + 1, dtype=torch.float32))
    for name, child in children:
        setattr(module, name, child)
    return module


def _set_child(parent: nn.Module, name: str, child: nn.Module) -> None:
    """Replace a child the way user code would: by index, by key, or by attribute."""
    if isinstance(parent, (nn.Sequential, nn.ModuleList)):
        parent[int(name)] = child
    elif isinstance(parent, nn.ModuleDict):
        parent[name] = child
    else:
        setattr(parent, name, child)


def build(case: TreeCase, mesh) -> nn.Module:
    """The case as an nn.Module; call on every rank (DTensor params distribute collectively)."""
    root = _build(case.root, "", case.seed, mesh)
    for src, dst in case.shared:
        parent, name = split_path(dst)
        _set_child(root.get_submodule(parent), name, root.get_submodule(src))
    for src, dst in case.tied:
        dst_mod, dst_name = split_path(dst)
        setattr(root.get_submodule(dst_mod), dst_name, root.get_parameter(src))
    return root


# ---------------------------------------------------------------------------
# Strategies.
# ---------------------------------------------------------------------------


class _Draft:
    """A node while drawing: mutable, so ties can rewrite a parameter in place."""

    def __init__(self, kind: str):
        self.kind = kind
        self.params: list[ParamSpec] = []
        self.buffers: tuple[str, ...] = ()
        self.children: list[tuple[str, _Draft]] = []

    def freeze(self) -> Node:
        return Node(self.kind, tuple(self.params), self.buffers,
                    tuple((n, c.freeze()) for n, c in self.children))


# The strategies a tree draws from are built once: hypothesis validates a strategy object
# the first time it is drawn from, and a tree draws from a hundred (half the drawing time).
@functools.cache
def _layouts(ndim: int, mesh_ndim: int) -> st.SearchStrategy:
    one = st.one_of(st.just(Replicate()), st.integers(0, ndim - 1).map(Shard))
    return st.one_of(st.none(), st.lists(one, min_size=mesh_ndim, max_size=mesh_ndim).map(tuple))


@functools.cache
def _shapes(ndim: int, largest: int) -> st.SearchStrategy:
    return st.lists(st.integers(1, largest), min_size=ndim, max_size=ndim).map(tuple)


@functools.cache
def _names(pool: tuple[str, ...], n: int) -> st.SearchStrategy:
    return st.lists(st.sampled_from(pool), min_size=n, max_size=n, unique=True)


def _param_spec(draw, name: str, mesh_shape: tuple[int, ...]) -> ParamSpec:
    # up to 2*max(mesh)+1 per dim: shards come out even, uneven, and smaller than the mesh
    ndim = draw(st.integers(1, 2))
    shape = draw(_shapes(ndim, 2 * max(mesh_shape) + 1))
    placements = draw(_layouts(ndim, len(mesh_shape)))
    return ParamSpec(name, shape, placements, draw(st.sampled_from((True, False))))


def _draw_node(draw, kind: str, levels: int, spine: bool, parent_kind: str | None,
               budget: dict, mesh_shape: tuple[int, ...]) -> _Draft:
    """A subtree at most ``levels`` deep; exactly that deep when on the ``spine``."""
    node = _Draft(kind)
    room = levels > 1
    most = (2 if kind == "module" else 3) if room else 0
    extra = draw(st.integers(0, min(most, budget["nodes"])))
    budget["nodes"] -= extra
    spine_at = draw(st.integers(0, extra)) if spine and room else None
    n_children = extra + (spine_at is not None)

    if kind == "module":
        n_params = draw(st.integers(0, min(3, budget["params"])))
        budget["params"] -= n_params
        n_buffers = draw(st.integers(0, 2))
        names = draw(_names(NAMES, n_params + n_buffers + n_children))
        node.params = [_param_spec(draw, n, mesh_shape) for n in names[:n_params]]
        node.buffers = tuple(names[n_params:n_params + n_buffers])
        child_names = names[n_params + n_buffers:]
    elif kind == "moduledict":
        child_names = draw(_names(DICT_KEYS, n_children))
    else:
        child_names = [str(i) for i in range(n_children)]

    # Sequential.forward chains its children, so they must be callable; leaves are modules.
    allowed = CALLABLE_KINDS if kind == "sequential" else KINDS
    for i, name in enumerate(child_names):
        child_kind = draw(st.sampled_from(allowed)) if levels > 2 else "module"
        child = _draw_node(draw, child_kind, levels - 1, i == spine_at, kind, budget, mesh_shape)
        node.children.append((name, child))
    return node


def _module_table(root: _Draft) -> list[tuple[str, str, str]]:
    """(path, kind, parent kind) of every module but the root, preorder."""
    rows = []

    def walk(node: _Draft, prefix: str) -> None:
        for name, child in node.children:
            path = join_path(prefix, name)
            rows.append((path, child.kind, node.kind))
            walk(child, path)

    walk(root, "")
    return rows


def _shareable(table, shared) -> list[tuple[str, str]]:
    """(src, dst) pairs that keep the sharing well defined and acyclic.

    dsts never nest in one another, and no src is in or around any dst: then every path
    still names what it named in the drawn tree, sources are untouched subtrees, and the
    order the pairs are applied in does not matter.
    """
    kinds = {path: kind for path, kind, _ in table}
    parent_kinds = {path: pk for path, _, pk in table}
    pairs = []
    for dst, _, _ in table:
        if any(is_under(dst, d) or is_under(d, dst) or is_under(dst, s) or is_under(s, dst) for s, d in shared):
            continue
        for src, _, _ in table:
            if is_under(src, dst) or is_under(dst, src):
                continue
            if any(is_under(src, d) or is_under(d, src) for _, d in shared):
                continue
            if parent_kinds[dst] == "sequential" and kinds[src] not in CALLABLE_KINDS:
                continue
            pairs.append((src, dst))
    return pairs


def _tieable(root: _Draft, shared, tied) -> list[tuple[str, str]]:
    """(src, dst) parameter pairs: both still reachable (not inside a replaced dst),
    and no chains: a dst is tied once and is never a src."""
    live = [
        join_path(path, p.name)
        for path, node in _draft_nodes(root, "")
        if not any(is_under(path, d) for _, d in shared)
        for p in node.params
    ]
    srcs, dsts = {s for s, _ in tied}, {d for _, d in tied}
    return [(s, d) for d in live if d not in srcs and d not in dsts
            for s in live if s != d and s not in dsts]


def _draft_nodes(node: _Draft, prefix: str) -> Iterator[tuple[str, _Draft]]:
    yield prefix, node
    for name, child in node.children:
        yield from _draft_nodes(child, join_path(prefix, name))


def _tie(root: _Draft, src: str, dst: str) -> None:
    """Give dst the src's spec, so the tied pair agrees on shape, layout and requires_grad."""
    src_mod, src_name = split_path(src)
    dst_mod, dst_name = split_path(dst)
    spec = next(p for p in dict(_draft_nodes(root, ""))[src_mod].params if p.name == src_name)
    dst_node = dict(_draft_nodes(root, ""))[dst_mod]
    dst_node.params = [replace(spec, name=dst_name) if p.name == dst_name else p for p in dst_node.params]


@st.composite
def module_trees(draw, world_size: int, max_depth: int = 6) -> TreeCase:
    """Module trees for a mesh of ``world_size`` ranks, 1 to ``max_depth`` levels deep.

    Every choice starts from its simplest option (depth 1, kind "module", no children,
    no params, plain params, no sharing), so failures shrink toward small trees.
    """
    mesh_shape = draw(mesh_shapes(world_size, 2))
    levels = draw(st.integers(1, max_depth))
    budget = {"params": MAX_PARAMS, "nodes": MAX_EXTRA_NODES}
    root = _draw_node(draw, "module", levels, True, None, budget, mesh_shape)

    shared: list[tuple[str, str]] = []
    for _ in range(draw(st.integers(0, 2))):
        pairs = _shareable(_module_table(root), shared)
        if not pairs:
            break
        shared.append(draw(st.sampled_from(pairs)))

    tied: list[tuple[str, str]] = []
    for _ in range(draw(st.integers(0, 2))):
        pairs = _tieable(root, shared, tied)
        if not pairs:
            break
        src, dst = draw(st.sampled_from(pairs))
        _tie(root, src, dst)
        tied.append((src, dst))

    return TreeCase(root.freeze(), mesh_shape, tuple(shared), tuple(tied), draw(st.integers(0, 2**16)))
