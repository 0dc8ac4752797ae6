"""docs/cli.md's option tables say each option's default as the code has it: read from the
parser (gate, plan) and the plugin's OPTIONS, so a changed default cannot leave the docs
behind (they once gave --dp's as ddp; it is fsdp2)."""

import argparse
import re
from pathlib import Path

import pytest

from tpdp_verify import cli, plugin

DOCS = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()


def _sections() -> dict[str, str]:
    """Each ``## `tpdp-verify X``` section's text, and the pytest plugin's."""
    parts = re.split(r"^## ", DOCS, flags=re.M)
    return {p.split("\n", 1)[0].strip("` ").removeprefix("tpdp-verify "): p for p in parts[1:]}


def _documented(section: str) -> dict[str, str]:
    """Option -> the default its table row gives ("" where none); a row of several options
    (``--steps``, ``--batch``) gives theirs in order, comma separated."""
    out = {}
    for row in re.findall(r"^\| (`-[^|]*?) \|([^|]*)\|", section.replace("\\|", "/"), flags=re.M):
        options = re.findall(r"`(-[-\w]+)", row[0])
        cells = row[1].split(",") if len(options) > 1 else [row[1]]
        defaults = [d.strip().strip("`") for d in cells]
        out |= dict(zip(options, defaults + [""] * len(options)))
    return out


def _said(value) -> str:
    if isinstance(value, tuple):
        return "x".join(map(str, value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


@pytest.mark.parametrize("command", ["gate", "plan"])
def test_each_command_options_default_is_the_documented_one(command):
    documented = _documented(_sections()[command])
    checked = 0
    for action in cli._subparser(command)._actions:
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        option = next(o for o in action.option_strings if o.startswith("--"))
        assert option in documented, f"docs/cli.md's {command} table has no row for {option}"
        assert documented[option] == _said(action.default), (option, documented[option], action.default)
        checked += 1
    assert checked >= 5


def test_the_plugins_options_defaults_are_the_documented_ones():
    documented = _documented(_sections()["pytest plugin"])
    for key, (default, _) in plugin.OPTIONS.items():
        option = f"--tpdp-{key.replace('_', '-')}"
        assert option in documented, f"docs/cli.md's plugin table has no row for {option}"
        assert documented[option] == default, (option, documented[option], default)
