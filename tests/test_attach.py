"""Attach mode: under torchrun the same API runs on the launcher's process group."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import sys
import torch.distributed as dist
import rank_fns
from tpdp_verify.errors import RankFailed
from tpdp_verify.ranks.pool import RankPool

pool = RankPool()
assert pool.attached and pool.pids == []
results = pool.run(rank_fns.rank_and_sum, "attached")
ids = pool.run(rank_fns.mesh_identity)
try:
    pool.run(rank_fns.raise_on, 1)
    failed = "no error"
except RankFailed as exc:
    failed = str(exc).splitlines()[0]
with open(f"{sys.argv[1]}/rank{dist.get_rank()}.txt", "w") as f:  # one file a rank: no interleaving
    f.write(f"rank {dist.get_rank()}: {[r[0] for r in results]} {results[0][2].item()} "
            f"{ids[0][1:]} | {failed}")
pool.close()
"""


def torchrun(code: str, ranks: int, tmp_path: Path) -> None:
    """Run ``code`` as a script under torchrun with ``ranks`` ranks (tests/ importable);
    it gets ``tmp_path`` as its argument, to write one file a rank."""
    script = tmp_path / "script.py"
    script.write_text(code)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=150,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)},
    )
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.timeout(180)
def test_pool_runs_on_the_torchrun_group(tmp_path):
    torchrun(SCRIPT, 4, tmp_path)
    for rank in range(4):
        line = (tmp_path / f"rank{rank}.txt").read_text()
        assert line == (f"rank {rank}: [0, 1, 2, 3] 6.0 (True, ('dp', 'tp'), 2) | "
                        "`rank_fns.raise_on` raised on rank 1 of 4")


def test_world_size_must_match_the_launcher(monkeypatch):
    from tpdp_verify.errors import UsageError
    from tpdp_verify.ranks.pool import RankPool

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(UsageError, match="torchrun launched 4 ranks but the pool asked for 2"):
        RankPool(2)


PLAN_SCRIPT = """
import os
import sys
import user_models as um
from tpdp_verify import verify_plan

report = verify_plan(um.make_mlp, um.PLAN, mesh=(1, 2), input_fn=um.vectors, steps=1, impl="reference")
# verify_plan's own pool initialized the group and has destroyed it: the rank is torchrun's.
with open(f"{sys.argv[1]}/rank{os.environ['RANK']}.txt", "w") as f:
    f.write(f"{report.ok} {sum(x.compared for x in report.lines)}")
"""


@pytest.mark.timeout(180)
def test_verify_plan_runs_on_the_torchrun_group(tmp_path):
    """docs/torchrun.md: the same call under torchrun, every rank the same report."""
    torchrun(PLAN_SCRIPT, 2, tmp_path)
    lines = {(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)}
    assert len(lines) == 1, lines
    ok, compared = lines.pop().split()
    assert ok == "True" and int(compared) > 50
