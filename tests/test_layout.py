"""The layout's promises (docs/architecture.md): dependencies point one way, down the data
flow; nothing in the library imports the suite it runs; a case is plain data."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Where each installed package's source lives (pyproject.toml's package-dir).
FOLDERS = {"tpdp_verify": "tpdp_verify", "tpdp_verify.oracles": "oracles",
           "tpdp_verify.properties": "properties", "tpdp_verify.fixtures": "fixtures"}
# Lowest first: a module imports only from its own layer and the layers below it.
LAYERS = (
    ("tpdp_verify.errors", "tpdp_verify.signature", "tpdp_verify.stacks", "tpdp_verify.files",
     "tpdp_verify.interrupts", "tpdp_verify.torch_internals", "tpdp_verify.hypothesis_internals",
     "tpdp_verify.status"),  # words every layer uses; ranks' stacks; writing files; signals; what each
    # torch release calls its private state; the hypothesis internals read; what each status means
    ("tpdp_verify.cases",),
    ("tpdp_verify.faults",),  # the catalog: which fault explains a case's failure
    ("tpdp_verify.fixtures",),
    ("tpdp_verify.impls",),
    ("tpdp_verify.ranks",),
    ("tpdp_verify.integrations",),  # the stacks users bring, run on the ranks as they come
    ("tpdp_verify.judging",),
    ("tpdp_verify.oracles",),
    ("tpdp_verify.runner",),
    # the interfaces, the suite beside them, and the transformers table that drives verify_plan
    ("tpdp_verify", "tpdp_verify.properties", "tpdp_verify.integrations.conformance"),
)
SUITE = "tpdp_verify.properties"


def _modules() -> dict[str, Path]:
    found = {}
    for package, folder in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every tpdp_verify module ``path`` imports, at the top or inside a function."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("tpdp_verify")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tpdp_verify"):
            out |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                    for a in node.names}
    return out


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _layer(module: str) -> int:
    """The layer of the longest prefix that names ``module``'s package."""
    best = max((p for layer in LAYERS for p in layer if module == p or module.startswith(p + ".")), key=len)
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def test_the_walk_found_the_library():
    assert len(MODULES) > 40 and all(GRAPH[m] for m in ("tpdp_verify.cli", "tpdp_verify.runner.gate"))


def test_every_import_points_down_the_layers():
    upward = [f"{m} (layer {_layer(m)}) imports {d} (layer {_layer(d)})"
              for m, deps in GRAPH.items() for d in deps if _layer(d) > _layer(m)]
    assert not upward, "\n".join(upward)


def test_nothing_in_the_library_imports_the_suite():
    """The gate finds the suite by its module's name (tpdp_verify.runner.suite)."""
    offenders = [f"{m} imports {d}" for m, deps in GRAPH.items() for d in deps
                 if d.startswith(SUITE) and not m.startswith(SUITE)]
    assert not offenders, offenders


EXTRAS = {"transformers", "torchtitan"}  # the libraries users bring (pyproject's optional dependencies)


INTEGRATIONS = "tpdp_verify.integrations."  # where an extra is imported: on the ranks of a run that names it


def test_the_library_never_imports_an_optional_extra():
    """A user's model module imports transformers; tpdp-verify only runs it (tpdp_verify.styles
    maps transformers' style strings without importing it). Only an integration module
    (transformers' own stack) imports its library, and nothing of the core imports such a
    module (the findings' records, which import no library, are read by `report`)."""
    seen = {name: {a.name.split(".")[0] for node in ast.walk(ast.parse(path.read_text()))
                   for a in (node.names if isinstance(node, ast.Import) else [])}
            | {(node.module or "").split(".")[0] for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ImportFrom)} for name, path in MODULES.items()}
    assert "torch" in seen["tpdp_verify.ranks.loop"]  # the walk sees imports
    assert "transformers" in seen[INTEGRATIONS + "transformers"]  # ... and an integration's library
    offenders = sorted(f"{m} imports {x}" for m, names in seen.items() for x in names & EXTRAS
                       if not m.startswith(INTEGRATIONS))
    offenders += sorted(f"{m} imports {d}" for m, deps in GRAPH.items() for d in deps
                        if d.startswith(INTEGRATIONS) and not m.startswith(INTEGRATIONS) and seen[d] & EXTRAS)
    assert not offenders, offenders


def test_no_import_cycle():
    cycles, state = [], {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = "open"
        for d in sorted(GRAPH.get(m, ())):
            if state.get(d) == "open":
                cycles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


@pytest.mark.parametrize("module", ["tpdp_verify.cases.training", "tpdp_verify.cases.tensors",
                                    "tpdp_verify.cases.trees"])
def test_a_case_is_plain_data(module):
    """Importing a case loads neither hypothesis nor DTensor: the parent, the ranks and a
    replay rebuild it without either."""
    code = (f"import sys, {module}; "
            "print(sorted(m for m in ('hypothesis', 'torch.distributed.tensor') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
