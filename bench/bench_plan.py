"""Benchmark: how long a cold ``tpdp-verify plan`` takes to give its verdict, and a typo's line.

Run as ``.venv/bin/python bench/bench_plan.py [--repeat N]``. Each run is a new process, as
a user's shell command is: the newcomer's model (bench/newcomer.py, 0.1 M parameters) on a
2x2 mesh (4 gloo ranks on this machine's cores), its correct plan under fsdp2, and under
ddp with the shipped baseline (torch 2.13's known registry fault: PASS but for known
faults, which also runs the explaining reruns); then the plan with a typo, refused before
any rank starts. The verdict is timed again with ranks spawned afresh
(TPDP_VERIFY_START_METHOD=spawn) to measure what forking them from a server that imported
torch once saves.

Where transformers is installed (the hf extra), the tiny transformers Llama of
tests/hf_models.py is timed too, with its own plan (--plan auto) under fsdp2.

Targets: a verdict within 10 s, a typo within 5 s (issue 15); the transformers Llama's
verdict within 20 s (issue 17); medians of N runs.
Exits 0 whatever the times are; exits 1 if a run does not end as it must (exit 0 for the
verdicts, 2 for the typo), so a broken run can never be what got timed.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
CLI = [str(Path(sys.executable).parent / "tpdp-verify"), "plan", "newcomer:make", "--input", "newcomer:tokens",
       "--mesh", "2x2"]
HF = ["plan", "hf_models:make_llama", "--plan", "auto", "--input", "hf_models:tokens", "--loss",
      "hf_models:model_loss", "--dp", "fsdp2", "--mesh", "2x2"]
RUNS = {  # name -> (arguments, environment, exit code it must end with)
    "verdict, fsdp2": (["--plan", "newcomer:PLAN", "--dp", "fsdp2"], {}, 0),
    "verdict, ddp + baseline": (["--plan", "newcomer:PLAN", "--dp", "ddp", "--baseline", "torch-2.13.0"], {}, 0),
    "typo": (["--plan", "newcomer:TYPO", "--dp", "fsdp2"], {}, 2),
    "verdict, fsdp2, spawned ranks": (["--plan", "newcomer:PLAN", "--dp", "fsdp2"],
                                      {"TPDP_VERIFY_START_METHOD": "spawn"}, 0),
}


def timed(args: list[str], env: dict, code: int) -> float:
    path = [str(HERE), str(HERE.parent / "tests"), os.environ.get("PYTHONPATH")]
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path)), **env}
    command = CLI[:1] + args if args[0] == "plan" else CLI + args
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=environ, cwd=HERE, timeout=300)
    took = time.perf_counter() - start
    if done.returncode != code:
        sys.exit(f"bench_plan: {' '.join(args)} exited {done.returncode}, not {code}:\n{done.stdout}{done.stderr}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    n = parser.parse_args().repeat
    print(f"tpdp-verify plan, cold, newcomer's model on a 2x2 mesh; {os.cpu_count()} CPUs; median of {n}")
    medians, runs = {}, dict(RUNS)
    if importlib.util.find_spec("transformers") is not None:
        runs["transformers Llama, fsdp2"] = (HF, {}, 0)
    for name, (args, env, code) in runs.items():
        times = [timed(args, env, code) for _ in range(n)]
        medians[name] = statistics.median(times)
        print(f"  {name:<32}{medians[name]:6.2f} s   (runs: {', '.join(f'{t:.2f}' for t in times)})")
    verdict = max(medians["verdict, fsdp2"], medians["verdict, ddp + baseline"])
    print(f"verdict / 10 s target: {verdict / 10:.2f}   typo / 5 s target: {medians['typo'] / 5:.2f}   "
          f"forked / spawned ranks: {medians['verdict, fsdp2'] / medians['verdict, fsdp2, spawned ranks']:.2f}"
          + (f"   transformers Llama / 20 s target: {medians['transformers Llama, fsdp2'] / 20:.2f}"
             if "transformers Llama, fsdp2" in medians else ""))


if __name__ == "__main__":
    main()
