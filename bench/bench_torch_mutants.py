"""The gate's power on torch's own code: each mutant of torch's transform (tests/torch_mutants.py)
through the whole gate, with the shipped baseline of torch 2.13.0, as a release engineer runs it.

A mutant is caught when the gate exits 1 with at least one NEW (or CHANGED) finding; the
control (torch's functions, unchanged, installed the same way) must exit 0. Prints a row a
mutant, then the score. About five minutes a mutant on 2 cores (the ci profile).

    python bench/bench_torch_mutants.py [--profile ci] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import torch_mutants  # noqa: E402  (tests/ on the path, as the ranks get it)


def gate(impl: str, profile: str) -> tuple[int, dict, float]:
    """Exit code, JSON record and seconds of one gate run with the shipped baseline."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "gate.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"),
                                                                           os.environ.get("PYTHONPATH")]))}
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "tpdp_verify", "gate", "--profile", profile, "--impl", impl,
                               "--baseline", "torch-2.13.0", "--json", str(out)],
                              capture_output=True, text=True, env=env)
        seconds = time.monotonic() - start
        record = json.loads(out.read_text()) if out.exists() else {}
        if not record:
            print(done.stderr[-2000:], file=sys.stderr)
        return done.returncode, record, seconds


def blocking(record: dict) -> list[str]:
    return [f"{p['name']} (world {p['world_size']}): {f['status']} {', '.join(f['signature'])}"
            for p in record.get("properties", []) for f in p["findings"] if f["status"] in ("NEW", "CHANGED")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--only", nargs="*", help="mutant class names (default: all, and the control)")
    args = parser.parse_args()
    mutants = [torch_mutants.TorchReference, *torch_mutants.TORCH_MUTANTS]
    if args.only:
        mutants = [m for m in mutants if m.__name__ in args.only]
    print(f"{'mutant':<30} {'exit':>4} {'caught':>7} {'seconds':>8}  first NEW finding")
    caught = 0
    for mutant in mutants:
        code, record, seconds = gate(f"torch_mutants.{mutant.__name__}", args.profile)
        new = blocking(record)
        control = mutant is torch_mutants.TorchReference
        ok = (code == 0 and not new) if control else (code == 1 and bool(new))
        caught += ok and not control
        print(f"{mutant.__name__:<30} {code:>4} {('as it should' if control else 'yes') if ok else 'NO':>7} "
              f"{seconds:>8.0f}  {new[0] if new else '-'}", flush=True)
        for more in new[1:]:
            print(f"{'':<52}{more}")
    total = len([m for m in mutants if m is not torch_mutants.TorchReference])
    print(f"caught {caught} of {total} torch mutants ({caught / max(total, 1):.0%}) against the shipped baseline")


if __name__ == "__main__":
    main()
