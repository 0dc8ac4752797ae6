"""A fault's record, the rules by which it explains a failure's parts, and a case's facts."""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from dataclasses import dataclass
from pathlib import Path

from tpdp_verify import signature

REPROS = Path(__file__).parent / "repros"
# whose code a fault or a finding is in, and where its issue is filed
PROJECTS = {"torch": "https://github.com/pytorch/pytorch/issues",
            "transformers": "https://github.com/huggingface/transformers/issues",
            "torchtitan": "https://github.com/pytorch/torchtitan/issues"}


@dataclass(frozen=True)
class Shows:
    """Where a fault shows: the signature parts it explains (fnmatch patterns; a raised
    part's pattern without a message matches whatever the exception said), in the
    properties named, on the cases whose facts match ``where`` (fact -> the values it may
    take; ``True``: any value but an empty one, ``False``: an empty one)."""

    parts: tuple[str, ...]
    properties: tuple[str, ...] = ("*",)
    where: tuple[tuple[str, object], ...] = ()

    def explains(self, part: str, prop: str, facts: dict) -> bool:
        named = (part, signature.api(part))
        return (any(fnmatch.fnmatchcase(n, p) for p in self.parts for n in named)
                and any(fnmatch.fnmatchcase(prop, p) for p in self.properties)
                and all(_holds(facts.get(name), want) for name, want in self.where))


def _holds(value, want) -> bool:
    if isinstance(want, bool):
        return bool(value) == want
    return value in want


@dataclass(frozen=True)
class Fault:
    number: int
    name: str  # a short name: "loss_parallel log_softmax backward"
    title: str
    what: str  # what goes wrong, and why (markdown)
    consequence: str
    workaround: str  # markdown; ``fix`` says it in one line
    fix: str
    entry_points: tuple[str, ...]  # the DP entry points it lives in (cases' ``entry``); () for none
    apis: tuple[str, ...]  # the torch APIs a user calls
    source: tuple[str, ...]  # "module:qualname" of torch's code at fault
    shows: tuple[Shows, ...]
    repro: str  # the file in repros/
    upstream: tuple[str, ...] = ()  # the issues and pull requests that report or fix it
    project: str = "torch"  # whose code is at fault (PROJECTS): the catalog's faults are torch's

    @property
    def releases(self) -> tuple[str, ...]:
        """The releases whose run of the reproduction shows it (tpdp_verify.faults.shown)."""
        from tpdp_verify.faults.shown import showing

        return showing(self.number)

    @property
    def label(self) -> str:
        return f"fault {self.number}, {self.name}"

    @property
    def repro_path(self) -> Path:
        return REPROS / self.repro

    def summary(self) -> dict:
        return {"number": self.number, "name": self.name, "title": self.title, "workaround": self.fix,
                "upstream": list(self.upstream), "project": self.project}


@dataclass(frozen=True)
class Explanation:
    """Which faults explain a failure's parts; ``unexplained``: the parts no record does."""

    faults: tuple[Fault, ...]
    unexplained: tuple[str, ...]

    @property
    def explained(self) -> bool:
        return not self.unexplained

    def line(self) -> str:
        """One line for a report: each fault with its workaround, then what none explains."""
        said = [f"{f.label} (workaround: {f.fix})" for f in self.faults]
        if self.unexplained:
            said.append("no catalogued fault explains " + ", ".join(self.unexplained))
        return "; ".join(said)

    def to_json(self) -> dict:
        return {"faults": [f.summary() for f in self.faults], "unexplained": list(self.unexplained)}


def facts(drawn: dict | None) -> dict:
    """A case's facts, by name: each field of its dataclass arguments (nested ones dotted:
    ``habits.ignored``, ``loss.kind``), the other arguments by their names, and the derived
    facts a fault's conditions name (below, each saying what it is)."""
    out: dict = {}
    for name, value in (drawn or {}).items():
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _flatten(value, "", out)
        else:
            out[name] = value
    for derive in (_mesh, _zoo, _ties, _fsdp2, _chunked, _nested, _tree):
        for name, value in derive(out, drawn or {}).items():
            out.setdefault(name, value)
    return out


def _mesh(out: dict, drawn: dict) -> dict:
    mesh = out.get("mesh_shape")
    if not isinstance(mesh, tuple) or not mesh:
        return {}
    said = {"tp": mesh[-1], "dp": math.prod(mesh[:-1]), "mesh_dims": len(mesh)}
    if len(mesh) == 3:  # HSDP's (dp_replicate, dp_shard, tp): FSDP1's hybrid shard group is one rank at dp_shard 1
        said |= {"dp_replicate": mesh[0], "dp_shard": mesh[1]}
    return said


# the widths each zoo model's plan shards over tp (fixtures/zoo.py, plans.py)
SHARDED = {"mlp": ("hidden",), "frozen": ("hidden",), "unused": ("hidden",), "buffers": ("hidden",),
           "nested": ("hidden",), "llama": ("dim", "hidden"), "llama_sp": ("dim", "hidden"),
           "llama_lm": ("dim", "hidden", "vocab"), "tied": ("hidden", "vocab"), "uneven": ("hidden", "dim"),
           "lm_head": ("hidden", "vocab"), "fused": ("hidden",)}
# the zoo models whose plan shards a weight per part over tp (a block of each part a rank)
PER_PART = ("fused",)
# the zoo models whose module DP is told to ignore (ranks/loop.py, ignorable) holds DTensors
IGNORED_TP = ("mlp", "llama_sp", "llama_lm", "tied", "unused", "uneven", "lm_head")


def _zoo(out: dict, drawn: dict) -> dict:
    model, tp = out.get("model"), out.get("tp")
    if model not in SHARDED or not isinstance(tp, int) or out.get("user") is not None:
        return {}
    from tpdp_verify.cases.training import empty_shard

    widths = [out[f"size.{w}"] for w in SHARDED[model]]
    return {"tp_empty": any(empty_shard(n, tp) for n in widths),  # torch.chunk leaves a tp rank no row of a width
            "tp_uneven": any(n % tp for n in widths),  # a sharded width does not divide by tp
            "tp_narrow": any(n < tp for n in widths),  # a sharded width has fewer rows than tp ranks
            "vocab_empty": "vocab" in SHARDED[model] and empty_shard(out["size.vocab"], tp),  # nor of the vocab
            "per_part": model in PER_PART,  # a weight sharded per part over tp (a user's: the plan report says)
            "ignored_tp": bool(out.get("habits.ignored")) and model in IGNORED_TP}


def _ties(out: dict, drawn: dict) -> dict:
    """Whether the model ties parameters: the zoo's ``tied``; a user's model says it in the
    drawn ``ties`` (a plan report passes its oracle's, which found them on one device)."""
    return {"ties": out.get("model") == "tied"} if "model" in out else {}


def _fsdp2(out: dict, drawn: dict) -> dict:
    if out.get("entry") not in ("fully_shard", "replicate_fsdp"):
        return {}
    mp = out.get("fsdp.mixed_precision")
    shards = out.get("dp_shard", out.get("dp", 1)) if out["entry"] == "fully_shard" else 1
    return {"policy_casts": mp is not None and mp != out.get("dtype"),  # FSDP2's param_dtype is not the data's
            "dp_sharded": shards > 1}  # FSDP2 shards the parameters over more than one dp rank


def _chunked(out: dict, drawn: dict) -> dict:
    """An FSDPCase's tensor: a DTensor on the tp dim (tp_placement), or a plain tensor (None)."""
    placement, tp = out.get("tp_placement", False), out.get("tp")
    if placement is False or not isinstance(tp, int):
        return {}
    sharded = placement is not None and placement.is_shard()
    return {"tp_sharded": sharded,  # a DTensor sharded over tp
            "tp_uneven": sharded and (out.get("shape") or ())[placement.dim] % tp != 0}  # its tp shards are uneven


def _nested(out: dict, drawn: dict) -> dict:
    """A NestedCase's tensor: whether some dim is sharded over two or more mesh dims of more
    than one rank and does not divide by their product (chunks of chunks, not one chunking).
    A training case's batch in the SPMD form with no DP wrapper on a 3-D mesh, sharded over
    both dp dims, whose flattened submesh the ranks build (tpdp_verify.ranks.tp_dp.on_the_whole_mesh):
    the same."""
    if out.get("entry") == "dtensor" and out.get("mesh_dims") == 3:
        both = out["dp_replicate"] > 1 and out["dp_shard"] > 1
        return {"flattened": True, "nested_unevenly": both and bool(out.get("batch_short", 0) % out["dp"])}
    if "flattened" not in out or not isinstance(out.get("placements"), tuple):
        return {}
    over: dict[int, list[int]] = {}
    for p, n in zip(out["placements"], out["mesh_shape"]):
        if p.is_shard() and n > 1:
            over.setdefault(p.dim, []).append(n)
    return {"nested_unevenly": any(len(ns) > 1 and out["shape"][d] % math.prod(ns) for d, ns in over.items())}


def _tree(out: dict, drawn: dict) -> dict:
    tree = next((v for v in drawn.values() if type(v).__name__ == "TreeCase"), None)
    if tree is None:
        return {}
    from tpdp_verify.cases.trees import nodes

    specs = {(f"{p}." if p else "") + s.name: s for p, n in nodes(tree.root) for s in n.params}
    dts = [s for s in specs.values() if s.placements is not None]
    return {"dtensor_params": bool(dts),  # the tree holds a DTensor parameter
            "frozen_dtensor": any(not s.requires_grad for s in dts),  # a DTensor parameter is frozen
            "tied_dtensor": any(specs.get(src) is not None and specs[src].placements is not None
                                for src, _ in tree.tied)}  # a tie shares a DTensor parameter


def _flatten(value, prefix: str, out: dict) -> None:
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            out[prefix + f.name] = True
            _flatten(v, f"{prefix}{f.name}.", out)
        else:
            out[prefix + f.name] = v
