"""One namespace: oracles/, properties/ and fixtures/ install as tpdp_verify.* both ways."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_editable_install_maps_the_top_level_folders():
    import tpdp_verify.fixtures
    import tpdp_verify.oracles
    import tpdp_verify.properties

    for module, folder in [(tpdp_verify.oracles, "oracles"), (tpdp_verify.properties, "properties"),
                           (tpdp_verify.fixtures, "fixtures")]:
        assert Path(module.__file__).parent == ROOT / folder


@pytest.mark.timeout(300)
def test_wheel_holds_one_namespace_and_both_entry_points(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path),
                    str(ROOT)], check=True, timeout=280)
    (wheel,) = tmp_path.glob("tpdp_verify-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for expected in ["tpdp_verify/ranks/pool.py", "tpdp_verify/oracles/__init__.py",
                     "tpdp_verify/properties/roundtrip.py", "tpdp_verify/fixtures/__init__.py",
                     "tpdp_verify/memos/torch-2.13.0.json"]:
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
    return found | {f"tpdp_verify.{top}" for top in ("oracles", "properties", "fixtures")}


def test_pyproject_lists_every_package_of_the_source_tree():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert "tpdp_verify.plan" in _source_packages()  # the one a hand-kept list once left out
    assert listed == _source_packages()
