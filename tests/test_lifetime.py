"""No rank outlives its parent: closed, exited, killed, or interrupted under pytest."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import wait_gone

POOL_SCRIPT = """
import sys, time
from tpdp_verify.ranks.pool import RankPool
if __name__ == "__main__":
    pool = RankPool(2, "gloo")
    print(" ".join(map(str, pool.pids)), flush=True)
    print(pool._ranks.stack_dir, flush=True)
    if sys.argv[1] == "linger":
        time.sleep(600)
"""


def _start(tmp_path, mode: str) -> tuple[subprocess.Popen, list[int], str]:
    script = tmp_path / "pool_script.py"
    script.write_text(POOL_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2, "the script did not start its ranks"
    stacks = proc.stdout.readline().strip()  # where the ranks write their stacks when asked
    assert os.path.isdir(stacks)
    return proc, pids, stacks


@pytest.mark.timeout(120)
def test_ranks_end_when_the_interpreter_exits_without_close(tmp_path):
    proc, pids, stacks = _start(tmp_path, "exit")
    assert proc.wait(60) == 0
    assert wait_gone(pids) == [] and not os.path.exists(stacks)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_end_when_the_parent_is_killed(tmp_path, sig):
    proc, pids, stacks = _start(tmp_path, "linger")
    proc.send_signal(sig)
    proc.wait(30)
    assert wait_gone(pids) == []  # the lifeline pipe closed with the parent
    assert not os.path.exists(stacks)  # a killed parent leaves it to its orphaned ranks to remove


USER_TEST = """
import os, time
def test_long(tpdp_pool):
    with open(os.environ["PIDS_FILE"], "w") as f:
        f.write(" ".join(map(str, tpdp_pool.pids)))
    tpdp_pool.run(time.sleep, 600)
"""


@pytest.mark.timeout(180)
def test_ranks_end_when_pytest_is_interrupted(tmp_path):
    (tmp_path / "test_user.py").write_text(textwrap.dedent(USER_TEST))
    pids_file = tmp_path / "pids"
    # Ctrl-C from a terminal: a shell that starts this suite in the background (`make test &`)
    # hands its children SIGINT ignored, so the user's pytest restores Python's handler.
    start = ("import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'test_user.py']))")
    proc = subprocess.Popen(
        [sys.executable, "-c", start],
        cwd=tmp_path, env={**os.environ, "PIDS_FILE": str(pids_file)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    deadline = time.monotonic() + 120
    while not (pids_file.exists() and pids_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(p) for p in pids_file.read_text().split()]
    time.sleep(1.0)  # the ranks are now inside the long call
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired as exc:  # say what was still running, then clean up
        tree = subprocess.run(["ps", "-e", "-o", "pid,ppid,stat,etime,args"], capture_output=True, text=True).stdout
        proc.kill()
        out, _ = proc.communicate()
        mine = [line for line in tree.splitlines() if any(str(p) in line.split()[:2] for p in [proc.pid, *pids])]
        pytest.fail(f"pytest did not end within 60 s of SIGINT ({exc}); its processes and ranks:\n"
                    + "\n".join(mine) + f"\n--- its output ---\n{out[-4000:]}")
    assert "KeyboardInterrupt" in out, out
    assert wait_gone(pids) == []
