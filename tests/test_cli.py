"""The gate from the shell: exit codes, the summary, and a replay script that replays."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tpdp_verify.properties import ALL, entry_points_train_like_one_device


def gate(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "tpdp_verify", "gate", *args],
                          capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.mark.timeout(300)
def test_gate_against_torch_reports_the_divergence_and_a_replay_that_fails_the_same_way(tmp_path):
    out = gate("--profile", "smoke")
    assert out.returncode == 1, out.stderr
    assert f"0 passed, {len(ALL)} diverged, 0 infrastructure failures" in out.stdout
    assert "== flatten_roundtrip (world size 2): diverges" in out.stdout
    replay = out.stdout.split("-- replay (save as a file and run it with python):\n", 1)[1]
    replay = replay.split("\n\n== ", 1)[0]  # the first property's script only
    (tmp_path / "replay.py").write_text(replay)
    replayed = subprocess.run([sys.executable, "replay.py"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
    assert replayed.returncode == 1
    assert "AssertionError" in replayed.stderr and "requires_grad (ranks 0, 1)" in replayed.stderr


@pytest.mark.timeout(300)
def test_gate_against_the_reference_passes_every_property_of_the_transform():
    """What still departs with the reference in place is torch's entry points' own."""
    out = gate("--profile", "smoke", "--impl", "reference")
    assert out.returncode == 1, out.stdout + out.stderr
    for prop in ALL:
        status = "DIVERGES" if prop is entry_points_train_like_one_device else "PASS"
        assert re.search(rf"{prop.name} +world 2 +{status} +\d+ examples", out.stdout), out.stdout
    assert f"{len(ALL) - 1} passed, 1 diverged, 0 infrastructure failures" in out.stdout


@pytest.mark.parametrize(
    "args, message",
    [(["--impl", "no_such_pkg.transform"],
      "tpdp-verify: error: implementation 'no_such_pkg.transform' does not import"),
     (["--impl", "json"], "tpdp-verify: error: implementation 'json' lacks flatten_tensor, unflatten_tensor, "),
     (["--profile", "nightly"], "invalid choice: 'nightly'")],
)
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    out = gate(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "tpdp-verify"
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "exit codes: 0 ok, 1 divergence found" in out.stdout
