"""The tests' own cache: what a baseline release answered (the user's memo) and the
environments installed for it are kept per session, never in the user's ~/.cache. And the
one smoke gate against the release that two test files judge."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

TESTS = Path(__file__).resolve().parent
# the gate whose outputs test_baseline and test_shards judge: the default profile (smoke)
# against the shipped baseline, nothing installed
SMOKE_AGAINST_THE_RELEASE = ("gate", "--profile", "smoke", "--baseline", "torch==2.13.0", "--no-install",
                             "--json", "gate.json", "--junit", "junit.xml")


# The test files taking the most of `make test`'s time, the longest first (its --durations,
# summed by file, 2026-11-29). xdist's loadfile hands a worker the next file in collection
# order as it frees up (with --no-loadscope-reorder, as `make test` runs it: by default xdist
# orders the files by their number of tests instead), so a long file collected late leaves
# the other worker idle at the end; handed out first, the short ones fill in after
# (longest-processing-time-first). test_baseline comes early: it makes the smoke run it
# shares with test_shards (conftest's smoke_against_the_release), which test_shards then
# reads at once rather than waiting on its lock. The rest keep their order, after these;
# within a file nothing moves.
LONGEST_FIRST = ("test_cli.py", "test_baseline.py", "test_gate_power.py", "test_repros.py", "test_training.py",
                 "test_replay.py", "test_conformance.py", "test_shards.py", "test_plugin.py", "test_torchtitan.py",
                 "test_packaging.py", "test_structure.py", "test_memo_answers.py", "test_transformers.py",
                 "test_fsdp_extension.py", "test_faults.py", "test_pool.py", "test_plan.py", "test_large_dp.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


_hypothesis_own: list = []  # hypothesis's reader of the local constants, as it came


@pytest.fixture(autouse=True, scope="session")
def _draws_of_the_case_space_alone():
    """Every hypothesis draw of the tests without the constants hypothesis reads from the
    local modules imported so far, as the gate draws (hypothesis_internals): with them a
    derandomized test's draw moved with whichever test files its xdist worker had run
    before, and a test that passed in one order failed in another."""
    from hypothesis.internal.conjecture import providers

    from tpdp_verify import hypothesis_internals

    _hypothesis_own.append(providers._get_local_constants)  # for with_local_constants
    with hypothesis_internals.without_local_constants():
        yield


@pytest.fixture
def with_local_constants(monkeypatch):
    """hypothesis's own local constants back, for a test that shows what they do."""
    from hypothesis.internal.conjecture import providers

    monkeypatch.setattr(providers, "_get_local_constants", _hypothesis_own[0])
    providers.CONSTANTS_CACHE.cache.clear()
    yield
    providers.CONSTANTS_CACHE.cache.clear()


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory):
    saved = os.environ.get("TPDP_VERIFY_CACHE")
    os.environ["TPDP_VERIFY_CACHE"] = str(tmp_path_factory.mktemp("tpdp-cache"))  # subprocesses inherit it
    yield
    if saved is None:
        os.environ.pop("TPDP_VERIFY_CACHE", None)
    else:
        os.environ["TPDP_VERIFY_CACHE"] = saved


@pytest.fixture(autouse=True, scope="session")
def _ranks_server(_own_cache):
    """Each worker's ranks fork from a server spawned now, as under the pytest plugin: else
    the first test that calls cli.main in process forks the server from itself, inside that
    test, and which test that is depends on how xdist hands out the files (twice a test
    failed only in one order). What a server forked from its caller keeps of it is
    tests/test_pool.py's, from scripts of their own."""
    from tpdp_verify.ranks.pool import warm_up

    warm_up()


@pytest.fixture(scope="session")
def smoke_against_the_release(tmp_path_factory):
    """SMOKE_AGAINST_THE_RELEASE run once a session, by whichever xdist worker asks first
    (pytest-xdist's recipe for a session fixture: a lock and the files in the workers' shared
    temp directory), the others reading what it left: a run takes a minute or more of both
    cores. Its directory (gate.json, junit.xml), exit code and output."""
    from filelock import FileLock  # torch's own dependency

    shared = tmp_path_factory.getbasetemp()
    shared = shared.parent if os.environ.get("PYTEST_XDIST_WORKER") else shared
    where = shared / "smoke-against-the-release"
    with FileLock(f"{where}.lock"):
        if not (where / "run.json").exists():
            where.mkdir(exist_ok=True)
            run = subprocess.run([sys.executable, "-m", "tpdp_verify", *SMOKE_AGAINST_THE_RELEASE],
                                 capture_output=True, text=True, cwd=where, timeout=580,
                                 env={**os.environ, "PYTHONPATH": str(TESTS)})  # toy_suite
            (where / "run.json").write_text(json.dumps({"returncode": run.returncode, "stdout": run.stdout,
                                                        "stderr": run.stderr}))
    return SimpleNamespace(dir=where, **json.loads((where / "run.json").read_text()))
