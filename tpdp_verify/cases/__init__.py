"""What a run is: plain, printable, picklable data (no torch.distributed, no hypothesis)."""


def mesh_kind(mesh: tuple[int, ...]) -> str:
    """Which of a (dp, tp) mesh's dimensions are real: "dp x tp", "tp", "dp" or "one rank"."""
    dp, tp = mesh[0], mesh[-1]
    return "dp x tp" if dp > 1 and tp > 1 else "tp" if tp > 1 else "dp" if dp > 1 else "one rank"
