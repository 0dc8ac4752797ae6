"""One namespace: oracles/, properties/ and fixtures/ install as tpdp_verify.* both ways."""

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import USER_MLP

ROOT = Path(__file__).resolve().parent.parent


def test_editable_install_maps_the_top_level_folders():
    import tpdp_verify.fixtures
    import tpdp_verify.oracles
    import tpdp_verify.properties

    for module, folder in [(tpdp_verify.oracles, "oracles"), (tpdp_verify.properties, "properties"),
                           (tpdp_verify.fixtures, "fixtures")]:
        assert Path(module.__file__).parent == ROOT / folder


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from this source tree."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(out), str(ROOT)],
                   check=True, timeout=280)
    (built,) = out.glob("tpdp_verify-*.whl")
    return built


@pytest.mark.timeout(300)
def test_wheel_holds_one_namespace_and_both_entry_points(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ["tpdp_verify/ranks/pool.py", "tpdp_verify/oracles/__init__.py",
                     "tpdp_verify/properties/roundtrip.py", "tpdp_verify/fixtures/__init__.py",
                     "tpdp_verify/memos/torch-2.13.0.json.gz", "tpdp_verify/docs/cli.md"]:
        assert expected in names
    assert not any(n.split("/")[0] in ("oracles", "properties", "fixtures", "tests") for n in names)
    source = {f"tpdp_verify/{p.relative_to(ROOT / 'tpdp_verify')}" for p in (ROOT / "tpdp_verify").rglob("*.py")}
    source |= {f"tpdp_verify/{p.relative_to(ROOT)}" for top in ("oracles", "properties", "fixtures")
               for p in (ROOT / top).rglob("*.py")}
    assert source - set(names) == set()  # every module of the source tree, tpdp_verify.plan's too
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "tpdp_verify = tpdp_verify.plugin" in text and "tpdp-verify = tpdp_verify.cli:console" in text


def _source_packages() -> set[str]:
    """Every package of the source tree (a folder of modules or of data), by the name it installs under."""
    folders = [ROOT / "tpdp_verify", *(p for p in (ROOT / "tpdp_verify").rglob("*") if p.is_dir())]
    found = {".".join(p.relative_to(ROOT).parts) for p in folders if p.name != "__pycache__"}
    return found | {f"tpdp_verify.{top}" for top in ("oracles", "properties", "fixtures", "docs")}


def test_pyproject_lists_every_package_of_the_source_tree():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert "tpdp_verify.plan" in _source_packages()  # the one a hand-kept list once left out
    assert listed == _source_packages()


PYTEST_USER = """
from mlp import PLAN, inputs, make_model


def test_my_plan(tpdp):
    assert tpdp.verify_plan(make_model, PLAN, input_fn=inputs).ok  # dp="fsdp2", the default
"""


@pytest.mark.timeout(600)
def test_the_installed_wheel_verifies_a_plan_from_outside_the_repository(wheel, tmp_path):
    """The wheel in a fresh venv with the pinned torch, used from a folder that is not the
    repository: verify_plan in Python, tpdp-verify plan, and the pytest fixture, with the
    defaults; the fault catalog and its reproductions (explain, report)."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "-c", str(ROOT / "constraints.txt"), str(wheel)],
                   check=True, timeout=480, capture_output=True)
    user = tmp_path / "user"
    user.mkdir()
    (user / "mlp.py").write_text(USER_MLP)
    (user / "test_mine.py").write_text(PYTEST_USER)
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("PYTHONPATH", "PYTEST_ADDOPTS")}

    def run(*command):
        return subprocess.run(command, cwd=user, env=env, capture_output=True, text=True, timeout=300)

    python_api = run(python, "-c", "from tpdp_verify import verify_plan\nfrom mlp import PLAN, inputs, make_model\n"
                     "if __name__ == '__main__':\n"
                     "    report = verify_plan(make_model, PLAN, input_fn=inputs)\n"
                     "    print(report.status)")
    assert python_api.returncode == 0 and python_api.stdout.splitlines()[-1] == "pass", python_api.stderr[-2000:]
    cli = run(str(venv / "bin" / "tpdp-verify"), "plan", "mlp:make_model", "--plan", "mlp:PLAN", "--input", "mlp:inputs")
    assert cli.returncode == 0 and ": PASS" in cli.stdout.splitlines()[0], cli.stdout[-2000:] + cli.stderr[-2000:]
    explain = run(str(venv / "bin" / "tpdp-verify"), "explain", "15")
    assert explain.returncode == 0 and explain.stdout.startswith("### 15. "), explain.stderr[-2000:]
    drafted = run(str(venv / "bin" / "tpdp-verify"), "report", "15", "--no-run")
    assert drafted.returncode == 0 and "def _log_softmax_backward_handler" in drafted.stdout, drafted.stderr[-2000:]
    fixture = run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_mine.py")
    assert fixture.returncode == 0 and "1 passed" in fixture.stdout, fixture.stdout[-3000:]
    # a baseline replayed from the checkout's root, whose tpdp_verify folder is not the package
    # (no properties in it): the installed one serves the candidate, its ranks and the replays
    gate = subprocess.run([str(venv / "bin" / "tpdp-verify"), "gate", "--profile", "smoke", "-k",
                           "chunk_tensor_metadata", "--seed", "20261128", "--baseline", "torch==2.13.0",
                           "--baseline-python", python], cwd=ROOT, env={**env, "TPDP_VERIFY_CACHE": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert gate.returncode == 0 and re.search(r"\b[1-9]\d* replayed there \(", gate.stdout), \
        gate.stdout[-2000:] + gate.stderr[-2000:]
    assert not any(str(ROOT) in p for p in run(python, "-c", "import tpdp_verify, tpdp_verify.plan;"
                                               "print(tpdp_verify.__file__, tpdp_verify.plan.__file__)").stdout.split())
