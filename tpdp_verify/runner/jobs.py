"""``gate --jobs N``: a run's searches in N parts at once on one machine.

Each part is a gate process of its own (``--shard K/N``: its own ranks, its own pools), so
independent searches use independent cores; ``merge`` puts the parts' records together,
and the verdict and every output are those of the run in one process. The parts run in
sessions of their own, so a signal (a terminal's Ctrl-C, a ``kill``) reaches them once,
passed on by this process: each writes what it judged, and the merged outputs say the run
was interrupted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from tpdp_verify.errors import PoolError
from tpdp_verify.files import run_directory
from tpdp_verify.interrupts import Interrupted

RANK_GIB = 1.0  # a rank's resident memory, about, at the suite's sizes (docs/performance.md)


def default_jobs(world_sizes: tuple[int, ...]) -> int:
    """As many parts as the cores and memory hold at the largest world size's ranks each."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    ranks = max(world_sizes)
    return max(1, min(cpus // ranks, int(memory // (ranks * RANK_GIB))))


def run(gate_args: list[str], n: int, progress=print) -> tuple[list[tuple[str, dict]], Interrupted | None]:
    """The gate with ``gate_args`` in ``n`` parts at once: each part's (path, record), and
    the signal that stopped the run, if one did (every part then wrote what it judged)."""
    from tpdp_verify.runner.merge import load

    directory = Path(run_directory())  # the parts' records, kept with the cache's newest runs
    paths = [directory / f"part{k}.json" for k in range(1, n + 1)]
    procs = [subprocess.Popen([sys.executable, "-m", "tpdp_verify", "gate", *gate_args, "--shard", f"{k}/{n}",
                               "--json", str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)  # a signal reaches a part once: passed on by this process
             for k, path in enumerate(paths, 1)]
    relays = [threading.Thread(target=_relay, args=(p, f"[{k}/{n}] ", progress), daemon=True)
              for k, p in enumerate(procs, 1)]
    for t in relays:
        t.start()
    stopped = None
    try:
        for p in procs:
            p.wait()
    except Interrupted as exc:  # pass it on, then let each part write
        stopped = exc
        for p in procs:
            if p.poll() is None:
                p.send_signal(exc.signum)
        for p in procs:
            p.wait()
    for t in relays:
        t.join()
    missing = [f"{k}/{n} (exit {p.returncode})" for k, (p, path) in enumerate(zip(procs, paths), 1)
               if not path.exists()]
    if missing:  # a part that wrote nothing ended before its run did: its own lines above say why
        raise PoolError(f"part{'s' * (len(missing) > 1)} {', '.join(missing)} of the run wrote no record; "
                        "its lines above say why")
    return [(str(path), load(str(path))) for path in paths], stopped


def _relay(proc: subprocess.Popen, prefix: str, progress) -> None:
    """A part's progress lines, and any line of its own about itself (an error, a signal);
    its summary and reports are the merged run's to print."""
    searching = True
    for line in proc.stdout:
        searching = searching and line.strip() != ""
        if searching or line.startswith("tpdp-verify:"):
            progress(prefix + line.rstrip("\n"))
