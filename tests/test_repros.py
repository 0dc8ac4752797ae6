"""Each catalogued fault's standalone reproduction, as a torch maintainer runs it: `python
FILE` from outside any checkout, torch alone, on the pinned torch 2.13.0. Each shows its
fault (exit 1) with what one device computes and what the ranks did."""

import ast

import pytest

from helpers import script_run
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
    and copied by `python -m tpdp_verify.faults.spawn_block` (and, given the files, into
    transformers' findings' reproductions), which this checks too."""
    from tpdp_verify.integrations.findings import FINDINGS  # another project's faults' reproductions too

    paths = [f.repro_path for f in faults.CATALOG] + [f.repro_path for f in FINDINGS]
    assert all(spawn_block.block(p) for p in paths)
    assert not spawn_block.differing(paths), "run python -m tpdp_verify.faults.spawn_block: " + ", ".join(
        p.name for p in spawn_block.differing(paths))
    from tpdp_verify.integrations.findings import BLOCKS

    for marker, codes in BLOCKS.items():  # the steps the findings' reproductions of a kind share
        kind = [f.repro_path for f in FINDINGS if f.code in codes]
        assert len(kind) == len(codes) >= 2 and all(spawn_block.block(p, marker) for p in kind)
        assert not spawn_block.differing(kind, marker), "run python -m tpdp_verify.integrations.findings"
        assert spawn_block.block(kind[0]).startswith(spawn_block.MARKER)  # the spawn block still the last
    copies = []
    for p in paths[:3]:
        copies.append(tmp_path / p.name)
        copies[-1].write_text(p.read_text())
    copies[1].write_text(copies[1].read_text().replace("GRACE_S)", "GRACE_S + 1)"))  # an edit the block lost
    assert spawn_block.differing(copies) == [copies[1]] and spawn_block.sync(copies) == [copies[1]]
    assert copies[1].read_text() == paths[1].read_text() and not spawn_block.differing(copies)
    marker, codes = next(iter(BLOCKS.items()))  # a block in the middle of a file: copied in its place
    kind = [tmp_path / f.repro_path.name for f in FINDINGS if f.code in codes[:2]]
    for f, copy in zip([f for f in FINDINGS if f.code in codes[:2]], kind):
        copy.write_text(f.repro_path.read_text())
    kind[1].write_text(kind[1].read_text().replace('"ran"', '"it ran"', 1))
    assert spawn_block.differing(kind, marker) == [kind[1]] and spawn_block.sync(kind, marker) == [kind[1]]
    assert kind[1].read_text() == next(f for f in FINDINGS if f.code == codes[1]).repro_path.read_text()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("fault", faults.CATALOG, ids=lambda f: f"fault{f.number}")
def test_the_reproduction_shows_its_fault_on_the_pinned_torch(fault):
    done = script_run(fault.repro_path, [f.repro_path for f in faults.CATALOG], timeout=180, bare_env=True)
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    assert lines[0].startswith("expected: ") and lines[1].startswith("actual:   "), done.stdout
    assert lines[-1] == "fault present", done.stdout


def test_fault_16s_reproduction_judges_the_sum_of_what_the_ranks_hand_over():
    """2.15.0 hands FSDP2's all-reduce over tp float32 partial gradients and sums them in
    float32: absent there, as the gate says (FIXED). 2.13.0 hands over bfloat16 ones and sums
    them in bfloat16: present. The reproduction once judged against bfloat16 partials it
    computed itself, and called 2.15.0's exact float32 sum a fault."""
    import importlib.util

    import torch

    path = next(f.repro_path for f in faults.CATALOG if f.number == 16)
    spec = importlib.util.spec_from_file_location("f16", path)
    f16 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(f16)
    partials = [torch.tensor([12.1961, 21.9072]), torch.tensor([12.0003, 21.9072])]

    def answers(dtype):  # (the full gradient, what each rank handed its all-reduce)
        summed = sum(p.to(dtype) for p in partials).float().tolist()
        return [(summed, [(str(dtype).removeprefix("torch."), p.to(dtype).float().tolist())]) for p in partials]

    assert f16.judge(answers(torch.float32))[1] is False
    said, present = f16.judge(answers(torch.bfloat16))
    assert present and "in bfloat16" in said and "(their bfloat16 sum)" in said
