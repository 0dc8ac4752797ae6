"""RankPool on real gloo ranks: results, mesh cache, and every failure mode for real."""

import os
import re
import signal
import threading
import time

import pytest
import torch

from tpdp_verify.errors import RankDied, RankFailed, RankTimeout, UsageError
from tpdp_verify.ranks import pool as pool_module
from tpdp_verify.ranks.pool import BASELINE_CALL, RankPool

import rank_fns
from helpers import alive, wait_gone

TIMEOUT = 4.0


@pytest.fixture(scope="module")
def ranks():
    with RankPool(4, "gloo", timeout=TIMEOUT, error_grace=1.0) as pool:
        yield pool


@pytest.fixture
def pool(ranks):
    ranks.run(rank_fns.rank_and_sum, 0)  # up, whatever the test before left (after a raise: fresh ranks)
    return ranks


def test_results_come_back_in_rank_order(pool):
    results = pool.run(rank_fns.rank_and_sum, "tag")
    assert [r[0] for r in results] == [0, 1, 2, 3]
    assert all(r[1] == "tag" and r[2].item() == 6.0 for r in results)


def test_device_mesh_is_created_once_per_shape(pool):
    first = pool.run(rank_fns.mesh_identity)
    second = pool.run(rank_fns.mesh_identity)
    assert first == second  # same object ids on every rank across calls
    assert all(same and names == ("dp", "tp") and tp == 2 for _, same, names, tp in first)


def test_mesh_that_does_not_fit_the_world_is_a_usage_error(pool):
    with pytest.raises(RankFailed) as info:
        pool.run(rank_fns.wrong_mesh)
    assert all(isinstance(e, UsageError) for e in info.value.exceptions.values())
    assert "mesh (3,) holds 3 ranks but the pool has 4" in str(info.value)


def test_exception_names_the_rank_and_carries_its_traceback(pool):
    spawns = pool.spawns
    with pytest.raises(RankFailed) as info:
        pool.run(rank_fns.raise_on, 2)
    message = str(info.value)
    assert "`rank_fns.raise_on` raised on rank 2 of 4" in message
    assert "Traceback" in message and "ValueError: boom on 2" in message
    assert set(info.value.tracebacks) == {2} and isinstance(info.value.exceptions[2], ValueError)
    assert len(pool.run(rank_fns.rank_and_sum, 1)) == 4
    assert pool.spawns == spawns  # raised before any collective, every group in step: the ranks stay


def test_ranks_that_raise_with_their_groups_in_step_take_the_next_run(pool):
    spawns, old = pool.spawns, pool.pids
    with pytest.raises(RankFailed):
        pool.run(rank_fns.reduce_then_raise)
    assert [t.item() for _, _, t in pool.run(rank_fns.rank_and_sum, 1)] == [6.0] * 4
    assert pool.spawns == spawns and pool.pids == old


def test_a_raise_that_leaves_torchs_state_changed_gets_fresh_ranks(pool):
    """torch 2.13's loss_parallel() leaves its handlers in DTensor's dispatcher when its body
    raises; every later cross-entropy of DTensors in the process would run them."""
    spawns = pool.spawns
    with pytest.raises(RankFailed):
        pool.run(rank_fns.raise_in_loss_parallel)
    assert pool.run(rank_fns.loss_handlers_installed) == [False] * 4
    assert pool.spawns == spawns + 1


def test_a_collective_a_failed_run_left_behind_never_reaches_the_next_run(pool):
    """Rank 0 starts an all_reduce and raises, the others raise before joining it: rank 0's
    bytes wait in the group, and the next run's all_reduce would meet them (gloo aborts on
    the size mismatch)."""
    spawns = pool.spawns
    with pytest.raises(RankFailed):
        pool.run(rank_fns.reduce_alone_then_raise)
    assert [t.item() for _, _, t in pool.run(rank_fns.rank_and_sum, 1)] == [6.0] * 4
    assert pool.spawns == spawns + 1  # rank 0's count is one ahead: fresh ranks


def test_exception_while_others_wait_in_a_collective_restarts_the_pool(pool):
    spawns, old = pool.spawns, pool.pids
    with pytest.raises(RankFailed) as info:
        pool.run(rank_fns.raise_while_others_reduce, 1)
    assert info.value.stuck == [0, 2, 3]
    assert "rank 1 leaves the collective" in str(info.value)
    assert "ranks 0, 2, 3 were still blocked 1 s later, using no CPU" in str(info.value)
    assert wait_gone(old) == []
    assert len(pool.run(rank_fns.rank_and_sum, 1)) == 4
    assert pool.spawns == spawns + 1


def test_a_rank_that_catches_while_others_wait_restarts_the_pool_before_the_timeout(pool):
    spawns, old = pool.spawns, pool.pids
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        pool.run(rank_fns.catch_while_others_reduce, 2)
    assert time.monotonic() - start < TIMEOUT  # the error grace (1 s), not the timeout
    assert info.value.stuck == [0, 1, 3]
    assert "raised on rank 2 of 4" in str(info.value) and "(caught and returned) rank 2 caught it" in str(info.value)
    assert wait_gone(old) == []
    assert len(pool.run(rank_fns.rank_and_sum, 1)) == 4
    assert pool.spawns == spawns + 1


def test_ranks_that_all_catch_return_their_results_and_take_the_next_run_in_step(pool):
    spawns = pool.spawns
    assert pool.run(rank_fns.everyone_catches) == [0, 1, 2, 3]
    assert len(pool.run(rank_fns.rank_and_sum, 1)) == 4
    assert pool.spawns == spawns


@pytest.mark.timeout(60)
def test_a_real_hang_is_detected_within_the_timeout_and_the_pool_respawns(pool):
    spawns, old = pool.spawns, pool.pids
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        pool.run(rank_fns.lone_collective, 0)
    elapsed = time.monotonic() - start
    assert TIMEOUT <= elapsed < TIMEOUT + 10
    assert info.value.silent == [0]
    assert "rank 0 of 4 did not answer" in str(info.value)
    # where it hangs: the silent rank's Python stack, and the collective it waits in
    assert list(info.value.stacks) == [0] and "lone_collective" in info.value.stacks[0]
    assert info.value.pending.startswith("torch/distributed/") and info.value.pending.endswith(":all_reduce")
    assert f"pending: {info.value.pending}" in str(info.value)
    assert "ranks 1, 2, 3 answered" in str(info.value)
    assert wait_gone(old) == []
    assert [r[0] for r in pool.run(rank_fns.rank_and_sum, 2)] == [0, 1, 2, 3]
    assert pool.spawns == spawns + 1


@pytest.mark.timeout(60)
def test_a_hang_names_every_silent_rank_stack_and_the_collective_they_wait_in(pool):
    stack_dir = pool._ranks.stack_dir
    with pytest.raises(RankTimeout) as info:
        pool.run(rank_fns.barrier_unless, 0)
    assert info.value.silent == [1, 2, 3]
    assert sorted(info.value.stacks) == [1, 2, 3]
    assert all("barrier_unless" in stack for stack in info.value.stacks.values())
    assert info.value.pending.startswith("torch/distributed/") and info.value.pending.endswith(":barrier")
    assert str(info.value).endswith(f"\npending: {info.value.pending}")
    assert not os.path.exists(stack_dir)  # the retired generation took its stack files along
    assert pool.run(rank_fns.barrier_unless, 4) == ["returned"] * 4


@pytest.mark.timeout(60)
def test_a_hang_is_said_within_seconds_with_where_the_ranks_wait(pool, monkeypatch):
    """A call unanswered for WAITING_NOTICE seconds is said once, naming the silent rank and
    the collective it waits in, long before the timeout; the hang then ends as before, and
    the stacks taken for the notice do not stand in for the timeout's."""
    said = []
    monkeypatch.setattr(pool_module, "WAITING_NOTICE", 1.0)
    monkeypatch.setattr(pool, "waiting", said.append)
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        pool.run(rank_fns.lone_collective, 0)
    assert len(said) == 1 and said[0].startswith("rank 0 of 4 has not answered `"), said
    assert ":all_reduce" in said[0] and f"at the {TIMEOUT:g} s timeout" in said[0]
    assert info.value.pending.endswith(":all_reduce") and info.value.stacks[0].count("Current thread") == 1
    assert time.monotonic() - start >= TIMEOUT
    assert pool.run(rank_fns.rank_and_sum, 1)[0][0] == 0 and len(said) == 1  # an answered call says nothing


def test_per_call_timeout_overrides_the_pool_default(pool):
    with pytest.raises(RankTimeout) as info:
        pool.run(rank_fns.sleep, 3.0, timeout=1.0)
    assert sorted(info.value.stacks) == [0, 1, 2, 3]
    assert all("in sleep" in stack for stack in info.value.stacks.values())
    assert info.value.pending == "" and "pending:" not in str(info.value)  # no collective
    assert pool.run(rank_fns.sleep, 0.0) == [0.0] * 4


@pytest.mark.timeout(90)
def test_after_a_hang_the_next_hang_is_cut_at_a_multiple_of_the_slowest_answered_call(monkeypatch):
    monkeypatch.setattr(pool_module, "HANG_FLOOR", 1.0)
    with RankPool(2, "gloo", timeout=8.0, after_hang=3.0) as pool:
        pool.run(rank_fns.sleep, 0.5)  # the slowest call that answers: about 0.5 s
        hangs = []
        for _ in range(2):
            start = time.monotonic()
            with pytest.raises(RankTimeout) as info:
                pool.run(rank_fns.lone_collective, 0)
            hangs.append((time.monotonic() - start, str(info.value)))
        (first, said_first), (second, said_second) = hangs
        assert first >= 8.0 and "within the 8 s timeout" in said_first  # the first hang: the whole timeout
        cut = 3.0 * pool.slowest
        assert 1.5 <= cut < 4.0 and cut <= second < 8.0, (cut, second)
        assert f"within the {cut:g} s timeout" in said_second
        assert pool.run(rank_fns.sleep, 3.0, timeout=6.0) == [3.0] * 2  # a call's own timeout still wins
        assert pool.run(rank_fns.sleep, 0.0) == [0.0] * 2


def test_taking_the_stacks_does_not_disturb_a_running_call(pool):
    spawns, taken = pool.spawns, {}
    ranks = pool._ranks
    timer = threading.Timer(0.5, lambda: taken.update(ranks.stacks([0, 1, 2, 3])))
    timer.start()
    try:
        results = pool.run(rank_fns.sleep_and_reduce, 1.5)
    finally:
        timer.join()
    assert [r.item() for r in results] == [6.0] * 4  # SIGUSR1 neither ended nor cut the call
    assert pool.spawns == spawns
    assert sorted(taken) == [0, 1, 2, 3] and all("sleep_and_reduce" in s for s in taken.values())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "how, said",
    [("exit", "exited with code 3"), ("sigkill", "was killed by SIGKILL"),
     ("segfault", "was killed by SIGSEGV"), ("abort", "was killed by SIGABRT")],
)
def test_a_dying_rank_is_reported_and_the_pool_respawns(pool, how, said):
    spawns, old = pool.spawns, pool.pids
    start = time.monotonic()
    with pytest.raises(RankDied) as info:
        pool.run(rank_fns.die_on, 3, how)
    assert time.monotonic() - start < TIMEOUT  # noticed at once, not at the timeout
    assert info.value.rank == 3 and f"rank 3 of 4 {said}" in str(info.value)
    assert info.value.signal == ("" if how == "exit" else said.rsplit(" ", 1)[1])
    assert wait_gone(old) == []
    assert len(pool.run(rank_fns.rank_and_sum, 3)) == 4
    assert pool.spawns == spawns + 1


def test_an_interrupted_call_retires_the_ranks(pool):
    """The caller gives up mid-call (Ctrl-C, pytest-timeout): no stale reply may leak into
    the next call, so the busy ranks are killed and the next call gets fresh ones."""
    old = pool.pids

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(KeyboardInterrupt):
            pool.run(rank_fns.sleep, 2.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert wait_gone(old) == []
    assert pool.run(rank_fns.sleep, 0.25) == [0.25] * 4


def test_a_function_that_cannot_be_sent_is_refused_before_any_rank_runs(pool):
    with pytest.raises(UsageError, match="use a module-level function"):
        pool.run(lambda: 1)


def test_a_dtensor_result_is_refused_with_advice(pool):
    with pytest.raises(RankFailed, match=r"return \.full_tensor\(\) or \.to_local\(\)"):
        pool.run(rank_fns.return_dtensor)


def test_two_pools_run_side_by_side_without_colliding():
    with RankPool(2, "gloo") as a, RankPool(2, "gloo") as b:
        assert [r[2].item() for r in a.run(rank_fns.rank_and_sum, "a")] == [1.0, 1.0]
        assert [r[2].item() for r in b.run(rank_fns.rank_and_sum, "b")] == [1.0, 1.0]
        assert set(a.pids).isdisjoint(b.pids)


def test_close_leaves_no_process_and_is_idempotent():
    pool = RankPool(2, "gloo")
    pids, stack_dir = pool.pids, pool._ranks.stack_dir
    assert all(alive(p) for p in pids) and os.path.isdir(stack_dir)
    pool.close()
    pool.close()
    assert not any(alive(p) for p in pids)
    assert not os.path.exists(stack_dir)


@pytest.mark.parametrize(
    "kwargs, message",
    [({"world_size": 0}, "world_size must be a positive integer"),
     ({"world_size": 2, "backend": "mpi"}, "backend must be auto, gloo or nccl"),
     ({"world_size": 2, "timeout": 0}, "timeout and start_timeout must be positive"),
     ({"world_size": 2, "max_rss_growth": 0}, "max_rss_growth must be a positive fraction")],
)
def test_bad_arguments_are_usage_errors(kwargs, message):
    with pytest.raises(UsageError, match=message):
        RankPool(**kwargs)


def test_the_ranks_output_directory_is_made_where_missing_and_an_unwritable_one_said(tmp_path):
    """Each rank opens its log there first thing: a missing directory killed every rank at
    start-up with no word of why."""
    out = tmp_path / "not" / "yet"
    with RankPool(2, "gloo", timeout=TIMEOUT, output=str(out)) as pool:
        pool.run(os.getpid)
    assert {p.name for p in out.iterdir()} == {"world2-rank0.log", "world2-rank1.log"}
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match=r"^cannot make the ranks' output directory .*/file/ranks: Not a directory; "):
        RankPool(2, "gloo", output=str(tmp_path / "file" / "ranks"))


def test_a_rank_that_outgrows_its_baseline_is_replaced_before_the_next_call():
    with RankPool(2, "gloo", timeout=TIMEOUT, max_rss_growth=0.1) as pool:
        first = pool.pids
        for call in range(BASELINE_CALL + 5):  # the baseline is taken at call 20; no growth
            pool.run(rank_fns.rank_and_sum, call)
        assert pool.spawns == 1 and pool.pids == first
        pool.run(rank_fns.hoard, 200)  # 200 MB kept alive: far past 10% of a rank
        assert pool.pids == first  # the ranks that answered stay up until the next call
        results = pool.run(rank_fns.rank_and_sum, "fresh")  # a collective: the new group works
        assert [(r[0], r[1], r[2].item()) for r in results] == [(0, "fresh", 1.0), (1, "fresh", 1.0)]
        assert pool.spawns == 2 and set(pool.pids).isdisjoint(first)
        assert not wait_gone(first)


@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason=f"NCCL needs one GPU a rank; this machine has {torch.cuda.device_count()}",
)
def test_nccl_pool_runs_on_gpus():
    with RankPool(2, "nccl") as pool:
        assert [r[2].item() for r in pool.run(rank_fns.rank_and_sum, "n")] == [1.0, 1.0]


def run_script(tmp_path, script: str, *args: str, unbuffered: bool = True):
    """``script`` run as a user's file of its own in ``tmp_path`` (tests/ on its path, for
    rank_fns), with ``args``; its completed process. ``unbuffered=False``: its stdout keeps a
    pipe's block buffer, whatever this process's environment says."""
    import subprocess
    import sys

    (tmp_path / "script.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(rank_fns.__file__),
                                                        os.environ.get("PYTHONPATH", "")])}
    if not unbuffered:
        env.pop("PYTHONUNBUFFERED", None)
    return subprocess.run([sys.executable, "script.py", *args], cwd=tmp_path, capture_output=True, text=True,
                          env=env, timeout=240)


SERVER_SCRIPT = """
import os
from multiprocessing import forkserver

import rank_fns
from tpdp_verify.ranks.pool import RankPool

if __name__ == "__main__":
    with RankPool(2) as pool:
        parents = pool.run(rank_fns.speak_and_say_parent)
    server = forkserver._forkserver._forkserver_pid
    print("server", server, os.readlink(f"/proc/{server}/fd/1"), parents)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the fork server's fds from /proc")
def test_ranks_fork_from_a_server_without_a_terminal_and_still_print_on_the_callers(tmp_path):
    """Ranks fork from a server that imported torch once. The server outlives the caller by
    its imports, so it holds none of the caller's stdio (a pipe reading it would stay open);
    each rank prints on the caller's stdout and stderr all the same."""
    done = run_script(tmp_path, SERVER_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 0 says hello" in done.stdout and "rank 1 says hello" in done.stdout
    assert "rank 0 writes to fd 2" in done.stderr and "rank 1 writes to fd 2" in done.stderr
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("server "))
    _, server, fd1, parents = line.split(" ", 3)
    assert fd1 == os.devnull
    assert parents == f"[{server}, {server}]"  # each rank forked from it


REPLACED_STREAMS_SCRIPT = """
import io
import sys

import rank_fns
from tpdp_verify.ranks.pool import RankPool, warm_up

if __name__ == "__main__":
    sys.stdout, sys.stderr = io.StringIO(), io.StringIO()  # as pytest's capture or a notebook has them
    warm_up(here=True)  # the CLI's first step, here called in process (cli.main)
    with RankPool(2, output=sys.argv[1]) as pool:
        pool.run(rank_fns.print_to_sys_stderr, "warns")
"""


def test_a_server_forked_from_a_caller_with_its_own_streams_gives_the_ranks_their_logs(tmp_path):
    """cli.main in a process whose sys.stderr is an object of its own (pytest's capture, a
    notebook's) forks the ranks' server from itself: what a rank prints through Python's
    sys.stderr still reaches its log, as from a spawned server (it once went into the rank's
    copy of the caller's object, and the ranks' logs came out empty)."""
    done = run_script(tmp_path, REPLACED_STREAMS_SCRIPT, str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} warns" in (tmp_path / f"world2-rank{rank}.log").read_text()


FORKED_SERVER_SCRIPT = """
import json
import os
import signal
from multiprocessing import forkserver

from tpdp_verify.ranks.pool import RankPool, warm_up

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: None)  # a command's own handler
    held = os.pipe()  # and a descriptor of its own
    print("printed before")  # left in the buffer: stdout is a pipe
    warm_up(here=True)
    server = forkserver._forkserver._forkserver_pid
    with RankPool(2) as pool:
        parents = pool.run(os.getppid)
    status = dict(line.split(":", 1) for line in open(f"/proc/{server}/status"))
    print(json.dumps({"server": server, "parents": parents, "me": os.getpid(),
                      "server_parent": int(status["PPid"]), "caught": int(status["SigCgt"], 16),
                      "held": [os.readlink(f"/proc/self/fd/{fd}") for fd in held],
                      "server_fds": [os.readlink(f"/proc/{server}/fd/{n}") for n in os.listdir(f"/proc/{server}/fd")]}))
"""


INHERITED_HANDLERS_SCRIPT = """
import logging
import sys

import rank_fns
from tpdp_verify.ranks.pool import RankPool, warm_up

if __name__ == "__main__":
    # Handlers on files of the caller's own, as pytest's logging plugin has one on /dev/null
    # for the whole run: enough of them to cover the low descriptors a rank opens.
    for n in range(12):
        logging.getLogger().addHandler(logging.FileHandler(f"{sys.argv[1]}/caller-{n}.log"))
    warm_up(here=True)  # the CLI's first step, here called in process (cli.main)
    with RankPool(2, timeout=60) as pool:
        for _ in range(3):
            answers = pool.run(rank_fns.log_to_the_root_logger, "logs")
            assert [a.tolist() for a in answers] == [[0, 1, 2, 3], [1, 2, 3, 4]], answers
    print("answered")
"""


def test_what_the_callers_objects_write_in_a_forked_server_goes_nowhere(tmp_path):
    """The forked server closes the caller's descriptors, but the caller's Python objects
    that hold them (a logging handler's file: pytest's on /dev/null) live on in it and in
    each rank, and a descriptor the rank opens later takes the same number: a warning
    logged through the root logger went into the rank's connection to the parent, whose
    next read took the text for a message's length and waited for a gigabyte (make test's
    checkpoint tests, once test_cli's in-process gate had forked the server). Now each such
    descriptor stays open on /dev/null: the rank's answers arrive, and the caller's files
    get nothing from the ranks. The root logger is a fresh interpreter's: the ranks'
    records reach their stderr."""
    done = run_script(tmp_path, INHERITED_HANDLERS_SCRIPT, str(tmp_path))
    assert done.returncode == 0 and "answered" in done.stdout, done.stderr[-3000:]
    assert not any("rank" in f.read_text() for f in tmp_path.glob("caller-*.log"))
    # the ranks' records where a spawned server's ranks write them: their stderr
    assert done.stderr.count("rank 0 logs") == 3 and done.stderr.count("rank 1 logs") == 3, done.stderr


CALLERS_FRAMES_SCRIPT = """
import rank_fns
from tpdp_verify import stacks
from tpdp_verify.errors import RankTimeout
from tpdp_verify.ranks.pool import RankPool, warm_up


def a_cell_of_the_users():  # the frame the ranks' server is forked in, as a notebook's cell
    warm_up(here=True)
    with RankPool(2, timeout=4) as pool:
        try:
            pool.run(rank_fns.barrier_unless, 0)
        except RankTimeout as hang:
            print(stacks.report(hang.stacks))


if __name__ == "__main__":
    a_cell_of_the_users()
"""


def test_a_rank_forked_from_a_callers_frames_is_placed_by_its_own(tmp_path):
    """A server forked from a command inside its caller's function holds that function's
    frames below its own, and so does each rank it forks: a hang's report named the
    caller's frame (a test of test_cli's, in make test) as where a rank waited. A rank's
    stack ends at its entry point: the silent rank is placed at the barrier it waits in."""
    done = run_script(tmp_path, CALLERS_FRAMES_SCRIPT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"^rank 1: at \S*rank_fns\.py:\d+ in barrier_unless$", done.stdout, re.M), done.stdout
    assert "a_cell_of_the_users" not in done.stdout and "script.py" not in done.stdout, done.stdout


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the fork server's fds from /proc")
def test_a_command_forks_the_ranks_server_from_itself_with_none_of_its_descriptors_or_handlers(tmp_path):
    """``warm_up(here=True)``, the CLI's first step: the server is the command forked once it
    has imported torch (torch imported once a command, not twice), and holds what a spawned
    server would: no descriptor of the command's but /dev/null as its stdio, no handler of
    the command's (SIGTERM ends it); it ends with the command. What the command printed
    before is printed once."""
    import json

    from helpers import wait_gone

    done = run_script(tmp_path, FORKED_SERVER_SCRIPT, unbuffered=False)  # stdout: a pipe's block buffer
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("printed before") == 1  # neither lost nor written again by the server
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["server_parent"] == seen["me"] and seen["parents"] == [seen["server"]] * 2  # forked from it
    assert not seen["caught"] & (1 << (signal.SIGTERM - 1))
    assert not set(seen["held"]) & set(seen["server_fds"]), seen
    assert seen["server_fds"][:3] == [os.devnull] * 3
    # its own: the listener, the "alive" pipe, its loop's selector and signal pipe, stdin reopened
    assert all(fd.startswith(("socket:", "pipe:", "anon_inode:", os.devnull)) for fd in seen["server_fds"][3:]), seen
    assert wait_gone([seen["server"]]) == []


@pytest.mark.timeout(60)
def test_ranks_blocked_in_a_collective_for_a_rank_that_raised_are_not_waited_out():
    """Ranks that use no CPU after another raised wait in a collective for it: reported
    stuck within a second or two, not after the whole error grace (here 30 s)."""
    with RankPool(4, "gloo", timeout=50.0, error_grace=30.0) as slow:
        start = time.monotonic()
        with pytest.raises(RankFailed) as info:
            slow.run(rank_fns.raise_while_others_reduce, 1)
        assert time.monotonic() - start < 30.0
        assert info.value.stuck == [0, 2, 3] and "using no CPU" in str(info.value)
        assert len(slow.run(rank_fns.rank_and_sum, 1)) == 4


def test_a_death_that_only_the_ranks_history_causes_is_judged_on_fresh_ranks(pool):
    """on_fresh_ranks: a rank that dies after earlier runs, and not on fresh ranks, leaves the
    verdict to the fresh run and its death to the record; one that dies again is the case's,
    and so is one on ranks that had run nothing: that run is not made twice."""
    from tpdp_verify.runner.property import on_fresh_ranks

    history: list = []
    pool.run(rank_fns.dies_after_another_run, 1)  # these ranks have run it now
    on_fresh_ranks(lambda: pool.run(rank_fns.dies_after_another_run, 1), history=history)
    assert len(history) == 1 and "rank 1 of 4 was killed by SIGSEGV" in history[0][0]
    with pytest.raises(RankDied):  # dies on fresh ranks too: its own death
        on_fresh_ranks(lambda: pool.run(rank_fns.die_on, 2, "segfault"), history=history)
    assert len(history) == 1
    # on ranks that have run nothing (the death retired the last ones) one run says it
    runs = []
    assert pool.fresh
    with pytest.raises(RankDied):
        on_fresh_ranks(lambda: (runs.append(1), pool.run(rank_fns.die_on, 2, "segfault")), history=history,
                       fresh=pool.fresh)
    assert len(runs) == 1 and len(history) == 1 and pool.fresh
    pool.run(rank_fns.rank_and_sum, 1)
    assert not pool.fresh


def test_the_fork_server_starts_under_a_temp_dir_too_long_for_its_socket(tmp_path):
    """A TMPDIR of 90 characters and more (a CI job's, pytest's nested temp dirs under
    xdist) once left no room for the fork server's socket path: an internal error, 'AF_UNIX
    path too long', before any rank started. Its directory goes in /tmp then, and at exit."""
    import subprocess
    import sys

    long = tmp_path / ("d" * 90)
    long.mkdir()
    code = "from tpdp_verify.ranks import pool; pool._start_server(pool._context()); print('started')"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(long)},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "started", out.stderr[-2000:]
    assert list(long.iterdir()) == []


def test_a_file_that_shadows_a_standard_module_beside_the_script_is_named_not_an_eof(tmp_path):
    """The fork server imports with the caller's sys.path, whose first entry is the script's
    directory: an enum.py there stood in for the standard enum and the server died, which
    reached the user as multiprocessing's bare 'EOFError: unexpected EOF'. Now a PoolError
    names the file."""
    import subprocess
    import sys

    (tmp_path / "enum.py").write_text("raise ImportError('not the standard enum')\n")
    (tmp_path / "use_pool.py").write_text(
        "from tpdp_verify.errors import PoolError\nfrom tpdp_verify.ranks.pool import RankPool\n"
        "if __name__ == '__main__':\n    try:\n        RankPool(2)\n    except PoolError as exc:\n"
        "        print(exc)\n")
    out = subprocess.run([sys.executable, "use_pool.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == (f"the ranks' fork server ended as it started a rank: {tmp_path / 'enum.py'} "
                                  "shadows the standard library's module of that name there; rename it"), \
        out.stdout + out.stderr[-2000:]
