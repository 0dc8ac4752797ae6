"""A module tree on a mesh: plain, printable, picklable data (properties/modules.py draws
it and builds it into the same ``nn.Module`` on every rank).

A ``TreeCase`` prints as constructor code, so a falsifying example replays by pasting it
(``from tpdp_verify.cases.trees import TreeCase, Node, ParamSpec`` and
``from torch.distributed.tensor import Shard, Replicate``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    from torch.distributed.tensor.placement_types import Placement


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: ``placements=None`` is a plain Parameter, else one placement a mesh dim."""

    name: str
    shape: tuple[int, ...]
    placements: tuple[Placement, ...] | None
    requires_grad: bool


@dataclass(frozen=True)
class Node:
    """One module. Only kind "module" holds params and buffers; containers hold children.

    Children of "sequential" and "modulelist" are named "0", "1", ...; of "moduledict",
    by key; of "module", by attribute name.
    """

    kind: str
    params: tuple[ParamSpec, ...] = ()
    buffers: tuple[str, ...] = ()
    children: tuple[tuple[str, "Node"], ...] = ()


@dataclass(frozen=True)
class TreeCase:
    """A module tree on a mesh, with sharing applied after building.

    shared: (src, dst) module paths; dst becomes the very module object at src.
    tied: (src, dst) parameter paths; dst becomes the very Parameter at src.
    """

    root: Node
    mesh_shape: tuple[int, ...]
    shared: tuple[tuple[str, str], ...] = ()
    tied: tuple[tuple[str, str], ...] = ()
    seed: int = 0


# ---------------------------------------------------------------------------
# Walking the plain data.
# ---------------------------------------------------------------------------


def join_path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def is_under(path: str, ancestor: str) -> bool:
    """``path`` is ``ancestor`` or inside it (by dotted atoms: "layer1" is not in "layer")."""
    return path == ancestor or path.startswith(ancestor + ".")


def nodes(node: Node, prefix: str = "") -> Iterator[tuple[str, Node]]:
    """Every (module path, node) of the drawn tree, preorder, before any sharing."""
    yield prefix, node
    for name, child in node.children:
        yield from nodes(child, join_path(prefix, name))


def depth(node: Node) -> int:
    """Levels of modules: a lone root is 1."""
    return 1 + max((depth(child) for _, child in node.children), default=0)


class _Obj:
    """A stand-in for one module object, to replay sharing and tying without torch."""

    def __init__(self, node: Node, path: str):
        self.params = {p.name: (join_path(path, p.name), p) for p in node.params}
        self.children = {name: _Obj(child, join_path(path, name)) for name, child in node.children}

    def get(self, path: str) -> "_Obj":
        obj = self
        for atom in path.split(".") if path else ():
            obj = obj.children[atom]
        return obj


def split_path(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition(".")
    return parent, name


def named_param_specs(case: TreeCase) -> list[tuple[str, ParamSpec]]:
    """(name, spec) as the built model's ``named_parameters()`` reports them.

    Replays torch's walk: modules preorder, a module object seen before is skipped with
    its subtree, a Parameter object seen before is skipped; the first name wins.
    """
    root = _Obj(case.root, "")
    for src, dst in case.shared:
        parent, name = split_path(dst)
        root.get(parent).children[name] = root.get(src)
    for src, dst in case.tied:
        src_mod, src_name = split_path(src)
        dst_mod, dst_name = split_path(dst)
        root.get(dst_mod).params[dst_name] = root.get(src_mod).params[src_name]

    out: list[tuple[str, ParamSpec]] = []
    seen_mods: set[int] = set()
    seen_params: set[str] = set()

    def walk(obj: _Obj, prefix: str) -> None:
        if id(obj) in seen_mods:
            return
        seen_mods.add(id(obj))
        for name, (identity, spec) in obj.params.items():
            if identity not in seen_params:
                seen_params.add(identity)
                out.append((join_path(prefix, name), replace(spec, name=name)))
        for name, child in obj.children.items():
            walk(child, join_path(prefix, name))

    walk(root, "")
    return out


def param_paths(case: TreeCase) -> list[str]:
    """The names ``named_parameters()`` gives for ``build(case, mesh)``, in its order."""
    return [path for path, _ in named_param_specs(case)]


def count_params(case: TreeCase) -> int:
    """Distinct Parameter objects in the built model (tied and shared ones count once)."""
    return len(named_param_specs(case))
