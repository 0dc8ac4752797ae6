"""Benchmark: a rank's answer pickled by tpdp_verify.ranks.wire against plain pickle.

Run as ``.venv/bin/python bench/bench_wire.py [--tensors N] [--repeat R]``. An answer shaped
as a training step's observation (N small float tensors, each with its int64 index, as a
rank's Pieces are) is dumped and loaded R times each way, in one run; the ratios are plain
pickle's time over the wire format's. Target: each ratio >= 4 (the parent unpickles every
rank's answer while the ranks wait). Exits 1 if the loaded answer differs from the one sent,
so a broken format can never be what got timed.
"""

from __future__ import annotations

import argparse
import pickle
import time

import torch

from tpdp_verify.ranks import wire


def _timed(fn, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=240)
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    answer = {f"value{i}": (torch.randn(8, 4), torch.arange(32).view(8, 4)) for i in range(args.tensors // 2)}
    plain, ours = pickle.dumps(answer), wire.dumps(answer)
    back = pickle.loads(ours)
    if not all(torch.equal(a, b) for k, v in answer.items() for a, b in zip(v, back[k])):
        print("the wire format changed the answer")
        return 1
    rows = [("dump", _timed(lambda: pickle.dumps(answer), args.repeat), _timed(lambda: wire.dumps(answer), args.repeat)),
            ("load", _timed(lambda: pickle.loads(plain), args.repeat), _timed(lambda: pickle.loads(ours), args.repeat))]
    print(f"{args.tensors} tensors; bytes: pickle {len(plain)}, wire {len(ours)}")
    for what, theirs, mine in rows:
        print(f"{what}: pickle {theirs * 1e3:.2f} ms, wire {mine * 1e3:.2f} ms, ratio {theirs / mine:.1f} (target >= 4)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
