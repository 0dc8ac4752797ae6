"""What a baseline release answered, remembered by the exact case it was asked about.

Known means "the baseline release shows the same failure on the same case". Asking costs a
run of the case on that release (tpdp_verify.runner.baseline), so each answer is kept: the
property, the world size and the case's identity are the key, the signature the release
showed there (``()``: it passes) the answer. A case's identity is its fields, those of each
dataclass in it that differ from their defaults (``identity``, revision ``IDENTITY``): a
field added with a default keeps every answer, where a printed form would lose them all. Each
answer keeps the printed form too, to rebuild the case (a replay, a rerun). A memo holds
answers of one release under one ``HARNESS`` revision, the other thing that decides what a
case computes; a memo of another revision answers nothing.

Two files are read: the memo tpdp-verify ships (``tpdp_verify/memos/torch-<release>.json.gz``,
the fixed draws of smoke, ci and release), and the user's (under the cache directory),
to which a run adds what it asked. Nothing here knows a case it was not asked about.
"""

from __future__ import annotations

import dataclasses
import fcntl
import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

from tpdp_verify import signature
from tpdp_verify.cases import case_types
from tpdp_verify.errors import UsageError
from tpdp_verify.files import cache_dir, write_whole

SCHEMA = 3
# Bump when a change of tpdp-verify alters what a case computes or how its failure is named
# (a check renamed, a value compared anew): the answers kept under the old revision no longer
# say what the release does on the case as it now runs.
HARNESS = 2  # 2: a raised part carries its message (signature.message); FSDP2's dp reduction is judged
# bumped when identity() keeps other things of a case: the answers' keys are computed anew.
# 2: every field that takes part in equality (1 left out those printed late, repr=False: the
# loss, the DP mesh dims, the clipping's way and norm, so cases that differ in them collided)
IDENTITY = 2
SHIPPED = Path(__file__).parent.parent / "memos"


def key(prop: str, world_size: int, drawn: dict) -> str:
    """A drawn case's key in the memo: its property, world size and identity."""
    return json.dumps([IDENTITY, prop, world_size, identity(drawn)], separators=(",", ":"), sort_keys=True)


def identity(drawn: dict) -> dict:
    """A case by its fields: argument -> value, a dataclass as its type and the fields that
    differ from their defaults (every one that takes part in its equality; a user's model is
    none where the memo is asked: the suite's cases hold no model), recursively; anything else
    by its repr."""
    return {name: _fields(value) for name, value in drawn.items()}


def _fields(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {"": type(value).__qualname__}
        for name, default in _defaults(type(value)):
            raw = getattr(value, name)
            given = _fields(raw)  # once: a subtree's fields, compared and kept
            if default is dataclasses.MISSING or (type(raw), given) != default:
                out[name] = given
        return out
    if isinstance(value, (list, tuple)):
        return [_fields(v) for v in value]
    if isinstance(value, dict):
        return {repr(k): _fields(v) for k, v in value.items()}
    return repr(value)


_DEFAULTS: dict[type, list] = {}


def _defaults(cls: type) -> list:
    """(name, default) for each field of ``cls`` that takes part in equality: the default's
    type and fields where it has one (a value equals it where both do: field by field, not
    by ``==``, since a tensor's is elementwise), else MISSING. Computed once a class; a
    case's identity is computed for every drawn case."""
    if cls not in _DEFAULTS:
        out = []
        for f in dataclasses.fields(cls):
            if not f.compare:
                continue
            default = f.default if f.default is not dataclasses.MISSING else \
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING
            out.append((f.name, default if default is dataclasses.MISSING else (type(default), _fields(default))))
        _DEFAULTS[cls] = out
    return _DEFAULTS[cls]


@dataclass(frozen=True)
class Asked:
    """One answer: the case as the baseline was asked (reprs, and the types to rebuild it),
    and its key (``key``: by identity, computed from the case when it was drawn)."""

    property: str
    world_size: int
    case: dict
    types: tuple
    signature: signature.Signature  # what the release showed; () where it passes
    key: str = ""

    def __post_init__(self):
        if not self.key:  # read from a memo of an earlier identity: the case rebuilt
            object.__setattr__(self, "key", key(self.property, self.world_size, self.drawn()))

    @classmethod
    def of(cls, prop: str, world_size: int, drawn: dict, shown: signature.Signature) -> "Asked":
        case, types = printed(drawn)
        return cls(prop, world_size, case, types, signature.of(shown), key(prop, world_size, drawn))

    def drawn(self) -> dict:
        """The case rebuilt from its printed form, as a replay script does."""
        return rebuild(self.case, self.types)

    def to_json(self) -> dict:
        return {"property": self.property, "world_size": self.world_size, "case": self.case,
                "types": list(self.types), "signature": list(self.signature), "key": self.key}


def printed(drawn: dict) -> tuple[dict, tuple]:
    """A drawn case as the memo keeps it: argument -> repr, and the project's types it names."""
    types = tuple(sorted(f"{t.__module__}:{t.__qualname__}" for t in case_types(drawn)))
    return {k: repr(v) for k, v in drawn.items()}, types


def rebuild(case: dict, types: tuple) -> dict:
    import importlib

    import torch
    from torch.distributed.tensor import Partial, Replicate, Shard

    names = {"torch": torch, "Replicate": Replicate, "Shard": Shard, "Partial": Partial}
    for path in types:
        module, _, qualname = path.partition(":")
        top = qualname.split(".")[0]
        try:
            names[top] = getattr(importlib.import_module(module), top)
        except (ImportError, AttributeError):
            raise UsageError(f"a memo's case names the type {path}, which this tpdp-verify does not have: "
                             "delete the memo (it is asked again)") from None
    return {k: eval(v, names) for k, v in case.items()}  # noqa: S307: reprs tpdp-verify wrote


@dataclass
class Memo:
    release: str  # the torch release answering, as pip spells it: 2.13.0
    answers: dict[str, Asked] = field(default_factory=dict)
    added: dict[str, Asked] = field(default_factory=dict)  # asked during this run: to be saved
    held_in: dict[str, Path] = field(default_factory=dict)  # key -> the file its answer was read from

    def get(self, prop: str, world_size: int, drawn: dict) -> Asked | None:
        return self.answers.get(key(prop, world_size, drawn))

    def put(self, asked: Asked) -> None:
        self.answers[asked.key] = self.added[asked.key] = asked

    def failing(self, prop: str, world_size: int) -> list[Asked]:
        """The cases of one search on which the release fails: those a run reruns to tell FIXED."""
        return [a for a in self.answers.values() if a.property == prop and a.world_size == world_size and a.signature]

    @classmethod
    def load(cls, release: str, paths: list[Path]) -> "Memo":
        memo = cls(release)
        for path in paths:
            for asked in read(path, release):
                memo.answers[asked.key], memo.held_in[asked.key] = asked, path
        return memo

    def save(self, path: Path) -> int:
        """Add this run's answers to the memo at ``path`` (others may have added theirs since:
        read, merged and written whole under a lock); the number it holds."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(_lock(path), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            held = {a.key: a for a in read(path, self.release)}
            held.update(self.added)
            doc = {"schema": SCHEMA, "harness": HARNESS, "identity": IDENTITY, "torch": self.release,
                   "asked": [a.to_json() for a in sorted(held.values(), key=lambda a: (a.property, a.world_size,
                                                                                      a.key))]}
            text = json.dumps(doc, indent=0, separators=(",", ":")) + "\n"
            write_whole(str(path), text, compressed=path.suffix == ".gz")
        return len(held)


def _lock(path: Path) -> Path:
    """The lock of a memo file, in the cache: never beside the file (the shipped one is in the package)."""
    import hashlib

    locks = cache_dir() / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return locks / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:16] + ".lock")


def read(path: Path, release: str) -> list[Asked]:
    """The answers a memo file holds for ``release`` under this HARNESS revision; none if it
    is missing, or of another revision or release (its answers do not hold here)."""
    if not path.exists():
        return []
    try:
        doc = json.loads(gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"cannot read the memo {path}: {exc}; delete it (its cases are asked again)") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or doc.get("harness") != HARNESS \
            or doc.get("torch") != release:
        return []
    keyed = doc.get("identity") == IDENTITY  # else each key is computed anew, from the case rebuilt
    try:
        return [Asked(a["property"], a["world_size"], a["case"], tuple(a["types"]), signature.of(a["signature"]),
                      a.get("key", "") if keyed else "") for a in doc["asked"]]
    except (KeyError, TypeError) as exc:
        raise UsageError(f"{path}: an answer lacks {exc}; delete the memo (its cases are asked again)") from None


def shipped(release: str) -> Path:
    """The memo tpdp-verify ships for ``release`` (compressed: thousands of cases)."""
    return SHIPPED / f"torch-{release}.json.gz"


def users(release: str) -> Path:
    return cache_dir() / "memos" / f"torch-{release}.json"
