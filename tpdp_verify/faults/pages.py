"""The catalog in words: a fault's section, and docs/known-divergences.md, made from the records."""

from __future__ import annotations

from tpdp_verify.faults.record import Fault, Shows

INTRO = """\
# Known divergences of torch 2.13.0

Generated from the fault catalog (`tpdp_verify/faults/catalog.py`) by
`tpdp-verify explain --all`; edit the catalog, not this page. `tpdp-verify explain N` prints
one fault, `tpdp-verify report N` an issue ready to file upstream, with the fault's standalone
reproduction (torch only: `python FILE` spawns its own gloo ranks on the CPU, exits 1 while
the fault is present).

A failure is **known** when torch 2.13.0 fails the same way on the same case: the gate asks
the release itself and keeps each answer in a memo (docs/cli.md, "Baselines"). The catalog
does not judge; it **names**: a failure is *explained* by the faults whose rules (below,
"Shows in") cover every part of its signature on its case. The gate's reports, JSON, JUnit,
Markdown, the pytest items and `verify_plan` name each failure's faults with a workaround; a
failure no record explains says so, for it is news even where 2.13.0 fails the same way.
"""


def table(catalog) -> str:
    rows = ["| fault | name | entry points | upstream |", "| ---: | --- | --- | --- |"]
    rows += [f"| [{f.number}](#{_anchor(f)}) | {f.name} | {', '.join(f.entry_points) or 'none'} | "
             f"{_upstream(f)} |" for f in catalog]
    return "\n".join(rows)


def section(f: Fault) -> str:
    """A fault as a reader wants it: what goes wrong, what it costs, the way round, where it
    lives in torch, where the suite meets it, how to reproduce it."""
    out = [f"### {f.number}. {f.title}", "", f.what.strip(), ""]
    out += [_item("Consequence", f.consequence), _item("Workaround", f.workaround)]
    out.append(f"- **Where:** {_entries(f)}; the APIs a user calls: " + ", ".join(f"`{a}`" for a in f.apis)
               + "; torch's code at fault: " + ", ".join(f"`{s}`" for s in f.source) + ".")
    out.append("- **Shows in:** " + ("; ".join(_shows(s) for s in f.shows) or "no property's verdict") + ".")
    out.append(f"- **Reproduction:** `tpdp_verify/faults/repros/{f.repro}` (torch only; "
               f"`tpdp-verify report {f.number}` prints it with what it shows here).")
    out.append(f"- **Releases that show it:** {', '.join(f.releases)}. **Upstream:** {_upstream(f)}.")
    return "\n".join(out)


def page(catalog) -> str:
    return "\n".join([INTRO, "## The faults", "", table(catalog), "", *(section(f) + "\n" for f in catalog)])


def _item(label: str, text: str) -> str:
    text = text.strip()
    return f"- **{label}:**\n  {text}" if text.startswith("- ") else f"- **{label}:** {text}"


def _entries(f: Fault) -> str:
    if not f.entry_points:
        return "no DP entry point (TP alone)"
    return "the DP entry points " + ", ".join(f"`{e}`" for e in f.entry_points)


def _shows(s: Shows) -> str:
    where = "".join(f", {name} {'set' if want is True else 'unset' if want is False else 'in ' + ', '.join(map(repr, want))}"
                    for name, want in s.where)
    return f"{', '.join(s.properties)} ({', '.join(f'`{p}`' for p in s.parts)}{where})"


def _upstream(f: Fault) -> str:
    """The fault's issues and pull requests: pytorch#N each, linked; a pull request marked."""
    if not f.upstream:
        return "none found"
    said = []
    for url in f.upstream:
        kind, number = url.rstrip("/").split("/")[-2:]
        said.append(f"[pytorch#{number}]({url})" + (" (pull request)" if kind == "pull" else ""))
    return ", ".join(said)


def _anchor(f: Fault) -> str:
    import re

    return re.sub(r"[^a-z0-9 -]", "", f"{f.number}. {f.title}".lower()).replace(" ", "-")
