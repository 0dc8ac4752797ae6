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


@pytest.fixture(autouse=True, scope="session")
def _own_cache(tmp_path_factory):
    saved = os.environ.get("TPDP_VERIFY_CACHE")
    os.environ["TPDP_VERIFY_CACHE"] = str(tmp_path_factory.mktemp("tpdp-cache"))  # subprocesses inherit it
    yield
    if saved is None:
        os.environ.pop("TPDP_VERIFY_CACHE", None)
    else:
        os.environ["TPDP_VERIFY_CACHE"] = saved


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
