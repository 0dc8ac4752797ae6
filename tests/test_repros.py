"""Each catalogued fault's standalone reproduction, as a torch maintainer runs it: `python
FILE` from outside any checkout, torch alone, on the pinned torch 2.13.0. Each shows its
fault (exit 1) with what one device computes and what the ranks did."""

import ast
import subprocess
import sys

import pytest

from tpdp_verify import faults
from tpdp_verify.faults import spawn_block

OWN = {"tpdp_verify", "oracles", "properties", "fixtures"}


@pytest.mark.parametrize("fault", faults.CATALOG, ids=lambda f: f"fault{f.number}")
def test_the_reproduction_needs_torch_alone(fault):
    tree = ast.parse(fault.repro_path.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & OWN, imported
    assert ast.get_docstring(tree).startswith(f"Fault {fault.number:02d} (torch 2.13.0)")


def test_every_reproduction_spawns_its_ranks_by_the_same_block(tmp_path):
    """Each file stands alone, so each carries the spawn, rendezvous (loopback only) and
    timeout code: fault 1's block, the same bytes in every file. A fix is made there once
    and copied by `python -m tpdp_verify.faults.spawn_block`, which this checks too."""
    paths = [f.repro_path for f in faults.CATALOG]
    assert all(spawn_block.block(p) for p in paths)
    assert not spawn_block.differing(paths), "run python -m tpdp_verify.faults.spawn_block: " + ", ".join(
        p.name for p in spawn_block.differing(paths))
    copies = []
    for p in paths[:3]:
        copies.append(tmp_path / p.name)
        copies[-1].write_text(p.read_text())
    copies[1].write_text(copies[1].read_text().replace("GRACE_S)", "GRACE_S + 1)"))  # an edit the block lost
    assert spawn_block.differing(copies) == [copies[1]] and spawn_block.sync(copies) == [copies[1]]
    assert copies[1].read_text() == paths[1].read_text() and not spawn_block.differing(copies)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault", faults.CATALOG, ids=lambda f: f"fault{f.number}")
def test_the_reproduction_shows_its_fault_on_the_pinned_torch(fault, tmp_path):
    done = subprocess.run([sys.executable, str(fault.repro_path)], capture_output=True, text=True, timeout=180,
                          cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert lines[0].startswith("expected: ") and lines[1].startswith("actual:   "), done.stdout
    assert lines[-1] == "fault present", done.stdout
