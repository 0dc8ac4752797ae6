"""The hypothesis internals tpdp-verify reads are there in the installed hypothesis, behind one
module whose range pyproject.toml states; nothing else imports hypothesis's internals."""

import ast
import re
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tpdp_verify import hypothesis_internals

ROOT = Path(__file__).resolve().parent.parent
PUBLIC = ("hypothesis", "hypothesis.strategies", "hypothesis.errors")


def test_every_internal_is_in_the_installed_hypothesis_within_the_supported_range():
    assert hypothesis_internals.missing() == []
    version = tuple(int(x) for x in metadata.version("hypothesis").split(".")[:2])
    major, minor, below = map(int, re.fullmatch(r">=(\d+)\.(\d+),<(\d+)", hypothesis_internals.SUPPORTED).groups())
    assert (major, minor) <= version and version[0] < below, version
    requires = [Requirement(r) for r in metadata.requires("tpdp-verify") if r.startswith("hypothesis")]
    assert [r.specifier for r in requires] == [SpecifierSet(hypothesis_internals.SUPPORTED)], requires


def test_nothing_else_imports_hypothesis_internals():
    found = []
    for folder in ("tpdp_verify", "properties", "oracles", "fixtures"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name == "hypothesis_internals.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                module = node.module if isinstance(node, ast.ImportFrom) else None
                if module and module.startswith("hypothesis") and module not in PUBLIC:
                    found.append(f"{path.relative_to(ROOT)}: {module}")
    assert found == []
