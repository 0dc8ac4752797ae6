"""Each run's rank logs live in a directory of its own under the cache's runs/, and the cache
keeps the newest RUNS_KEPT of the runs that have ended: a directory whose run still lives is
never removed, however many runs start beside it (gates, plan runs, shards and pytest
workers share one cache)."""

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor

from tpdp_verify import files

# one run: a process that takes its directory, writes into it, and prints where it is; a long
# one waits for its input to close before it writes its last file and checks the first
RUN = textwrap.dedent("""
    import os, sys
    from tpdp_verify.files import run_directory
    made = run_directory()
    with open(os.path.join(made, "first.log"), "w") as f:
        f.write("written at the start")
    print(made, flush=True)
    if sys.argv[1:] == ["long"]:
        sys.stdin.read()
        with open(os.path.join(made, "last.log"), "w") as f:  # raises if the directory went
            f.write("written at the end")
        assert open(os.path.join(made, "first.log")).read() == "written at the start"
""")


def _run(cache, *args, **kwargs):
    env = {**os.environ, "TPDP_VERIFY_CACHE": str(cache)}
    return subprocess.Popen([sys.executable, "-c", RUN, *args], env=env, text=True, stdout=subprocess.PIPE,
                            stdin=subprocess.PIPE, **kwargs)


def _short(cache) -> str:
    process = _run(cache)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0
    return out.strip()


def test_only_the_newest_ended_runs_are_kept(tmp_path):
    """An afternoon of runs once left 30 directories in the temp dir: the cache keeps 20."""
    made = [_short(tmp_path) for _ in range(files.RUNS_KEPT + 5)]
    kept = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert all(m.startswith(str(tmp_path / "runs")) for m in made)
    # the last run pruned while it lived, so RUNS_KEPT ended ones and itself stay
    assert kept == [os.path.basename(m) for m in made][-(files.RUNS_KEPT + 1):]


def test_a_long_run_keeps_its_directory_while_many_short_runs_start_beside_it(tmp_path):
    """A ci gate once lost its directory mid-way to the runs started beside it, then ended
    in an internal error writing its report. Here 3 * RUNS_KEPT short runs, four at a time,
    start and end while one long run lives; it keeps its files and writes its last one."""
    long = _run(tmp_path, "long")
    where = long.stdout.readline().strip()
    with ThreadPoolExecutor(4) as pool:
        shorts = list(pool.map(lambda _: _short(tmp_path), range(3 * files.RUNS_KEPT)))
    assert os.path.isfile(os.path.join(where, "first.log"))
    long.stdin.close()
    assert long.wait(timeout=60) == 0, "the long run lost its directory"
    assert os.path.isfile(os.path.join(where, "last.log"))
    ended = [p for p in (tmp_path / "runs").iterdir() if str(p) != where]
    # pruning still ran: the last prune kept RUNS_KEPT ended runs and the three still living beside it
    assert files.RUNS_KEPT <= len(ended) <= files.RUNS_KEPT + 3 and {str(p) for p in ended} <= set(shorts)
    assert not [p for p in (tmp_path / "runs").iterdir() if p.name.startswith(".")]  # no staging left


def test_a_killed_run_leaves_its_directory_to_be_pruned(tmp_path):
    """The lock goes with the process however it ends: a run killed mid-way does not pin
    its directory for ever."""
    killed = _run(tmp_path, "long")
    where = killed.stdout.readline().strip()
    killed.kill()
    killed.wait(timeout=60)
    made = [_short(tmp_path) for _ in range(files.RUNS_KEPT + 1)]
    assert not os.path.exists(where) and os.path.isdir(made[-1])


def test_a_directory_of_this_process_lives_until_it_ends(tmp_path, monkeypatch):
    """An in-process run (the plugin, the API) holds its directory too."""
    monkeypatch.setenv("TPDP_VERIFY_CACHE", str(tmp_path))
    mine = files.run_directory()
    for _ in range(files.RUNS_KEPT + 2):
        _short(tmp_path)
    assert os.path.isdir(mine)
