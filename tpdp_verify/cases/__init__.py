"""What a run is: plain, printable, picklable data (no torch.distributed, no hypothesis)."""

import dataclasses


def mesh_kind(mesh: tuple[int, ...]) -> str:
    """Which of a (dp, tp) mesh's dimensions are real: "dp x tp", "tp", "dp" or "one rank";
    of a 3-D (dp_replicate, dp_shard, tp) mesh, its real dimensions by name ("3-D: ...")."""
    if len(mesh) == 3:
        real = [n for n, s in zip(("dp_replicate", "dp_shard", "tp"), mesh) if s > 1]
        return f"3-D: {' x '.join(real) or 'one rank'}"
    dp, tp = mesh[0], mesh[-1]
    return "dp x tp" if dp > 1 and tp > 1 else "tp" if tp > 1 else "dp" if dp > 1 else "one rank"


def mesh_text(mesh) -> str:
    """A mesh as a report names it: "(dp=2, tp=2)", "(dp_replicate=2, dp_shard=2, tp=2)"."""
    names = ("dp_replicate", "dp_shard", "tp") if len(mesh) == 3 else ("dp", "tp")
    return "(" + ", ".join(f"{n}={s}" for n, s in zip(names, mesh)) + ")"


def case_types(value) -> set[type]:
    """The project's dataclasses a drawn value is made of, nested ones included: what its
    printed form names, and a script or a memo must import to rebuild it."""
    if dataclasses.is_dataclass(value):
        fields = (getattr(value, f.name) for f in dataclasses.fields(value))
        return {type(value)}.union(*map(case_types, fields))
    if isinstance(value, (tuple, list)):
        return set().union(*map(case_types, value))
    if isinstance(value, dict):
        return set().union(*map(case_types, value.values()))
    return set()
