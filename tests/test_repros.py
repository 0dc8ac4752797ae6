"""Each catalogued fault's standalone reproduction, as a torch maintainer runs it: `python
FILE` from outside any checkout, torch alone, on the pinned torch 2.13.0. Each shows its
fault (exit 1) with what one device computes and what the ranks did."""

import ast
import subprocess
import sys

import pytest

from tpdp_verify import faults

OWN = {"tpdp_verify", "oracles", "properties", "fixtures"}


@pytest.mark.parametrize("fault", faults.CATALOG, ids=lambda f: f"fault{f.number}")
def test_the_reproduction_needs_torch_alone(fault):
    tree = ast.parse(fault.repro_path.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & OWN, imported
    assert ast.get_docstring(tree).startswith(f"Fault {fault.number:02d} (torch 2.13.0)")


MARKER = "# --- boilerplate: WORLD gloo ranks on 127.0.0.1"


def test_every_reproduction_spawns_its_ranks_by_the_same_block():
    """Each file stands alone, so each carries the spawn, rendezvous (loopback only) and
    timeout code: one block, the same bytes in every file, so a fix to it is made once."""
    blocks = {f.number: f.repro_path.read_text().partition(MARKER)[2] for f in faults.CATALOG}
    assert all(blocks.values()) and len(set(blocks.values())) == 1, sorted(n for n, b in blocks.items()
                                                                          if b != blocks[1])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault", faults.CATALOG, ids=lambda f: f"fault{f.number}")
def test_the_reproduction_shows_its_fault_on_the_pinned_torch(fault, tmp_path):
    done = subprocess.run([sys.executable, str(fault.repro_path)], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert lines[0].startswith("expected: ") and lines[1].startswith("actual:   "), done.stdout
    assert lines[-1] == "fault present", done.stdout
