"""The fixed draw is a function of the case space, the seed and hypothesis's pinned version:
not of the source of the modules the searching process has imported, nor of the
property's own source.

Hypothesis draws one value in twenty from the constants it reads out of every local
module in ``sys.modules``, tpdp-verify's own included. A search that let it would draw
other cases after any edit of a literal in the tool, and other cases in the CLI than in
pytest, so a baseline learned from one draw would not meet the next: learned seeds
judged NEW. ``Property.run`` draws without them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import inspect
import linecache
import sys
import textwrap
from types import SimpleNamespace

from hypothesis import strategies as st
from hypothesis.internal.conjecture import providers

from tests.test_case_coverage import CI, drawn
from tpdp_verify.properties.training import trains_like_one_device
from tpdp_verify import hypothesis_internals
from tpdp_verify.runner import property as property_mod
from tpdp_verify.runner.property import Property

# integers over the range seeds are drawn from, none of them a literal of the tool (hypothesis
# reads at most a thousand from a module)
CONSTANTS = "\n".join(f"VALUE_{i} = {1009 + 157 * i}" for i in range(400))


def _import_local_constants(tmp_path, monkeypatch) -> None:
    """Import a local module of new constants, as an edit of the tool's own code adds
    them; hypothesis's record of the local constants is restored afterwards."""
    for name in ("_local_constants", "_seen_modules"):
        monkeypatch.setattr(providers, name, copy.deepcopy(getattr(providers, name)))
    path = tmp_path / "edited_code.py"
    path.write_text(CONSTANTS)
    spec = importlib.util.spec_from_file_location(f"edited_code_{tmp_path.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, spec.name, module)  # imported, and gone after the test
    providers.CONSTANTS_CACHE.cache.clear()


def _seeds_drawn() -> list:
    """What a property drawing 40 lists of ten case seeds draws under the ci profile."""
    seen = []

    def record(pool, impl, seeds):
        seen.append(seeds)

    prop = Property("seeds", record, {"seeds": st.lists(st.integers(0, 2**16), min_size=10, max_size=10)})
    prop.run(SimpleNamespace(world_size=2), "torch", CI)
    return seen


def test_a_search_draws_the_same_whatever_local_code_holds(tmp_path, monkeypatch):
    before = _seeds_drawn()
    _import_local_constants(tmp_path, monkeypatch)
    assert _seeds_drawn() == before


def test_without_the_guard_the_same_search_moves(tmp_path, monkeypatch, with_local_constants):
    """The test above can fail: hypothesis alone draws other seeds once local code holds more constants."""
    monkeypatch.setattr(hypothesis_internals, "without_local_constants", contextlib.nullcontext)
    before = _seeds_drawn()
    _import_local_constants(tmp_path, monkeypatch)
    assert _seeds_drawn() != before


def test_the_gate_draws_the_same_training_cases_whatever_local_code_holds(tmp_path, monkeypatch):
    before = drawn(trains_like_one_device, 4)
    _import_local_constants(tmp_path, monkeypatch)
    assert drawn(trains_like_one_device, 4) == before


def _edited(fn, doc: str):
    """``fn`` with its docstring edited, as an edit of the property's source."""
    source = textwrap.dedent(inspect.getsource(fn).replace(fn.__doc__, doc))
    source = source[source.index("def "):]
    filename = f"<edited {fn.__name__}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)  # for getsource
    namespace = dict(fn.__globals__)
    exec(compile(source, filename, "exec"), namespace)
    return namespace[fn.__name__]


def _drawn_by(prop: Property, fn) -> list:
    seen = []

    @functools.wraps(fn)
    def record(pool, impl, **drawn):
        seen.append(drawn)

    dataclasses.replace(prop, fn=record).run(SimpleNamespace(world_size=4), "torch", CI)
    return seen


def test_an_edit_of_a_propertys_docstring_draws_the_same_cases(monkeypatch):
    """Hypothesis's derandomize seeds from the test's source: a reworded docstring would
    draw other cases, which a baseline learned from the old ones never met. The fixed
    seeds are frozen per property (runner/fixed_seeds.json)."""
    prop = trains_like_one_device
    edited = _edited(prop.fn, "Reworded: trains like one device.")
    before = _drawn_by(prop, prop.fn)
    assert before and _drawn_by(prop, edited) == before
    # seeded by hypothesis alone (derandomize), the edit moves the draw
    monkeypatch.setattr(property_mod, "fixed_seed", lambda name, fn: None)
    assert _drawn_by(prop, edited) != _drawn_by(prop, prop.fn)


def test_every_frozen_seed_is_a_propertys_of_the_suite():
    """A renamed property would lose its frozen seed, and with it the draw its baseline
    entries were learned from: rename it in fixed_seeds.json too."""
    from tpdp_verify.runner import suite

    names = {p.name for p in suite.load().properties}
    assert set(property_mod._frozen()) <= names, set(property_mod._frozen()) - names
