"""The conformance suite as pytest items: ``pytest --pyargs tpdp_verify.properties``.

One item per property and world size of the profile (``trains_like_one_device[world_size=2]``),
run by the gate's own runner: the same search (``check_property``), judged by the same
baseline (``baseline.judge`` over the whole file, as the gate judges), reported with
the same text, signature and replay. An item passes, passes with its known faults listed
(``known`` in its JUnit properties), or fails with the report the CLI prints. Each pytest
process (a pytest-xdist worker too) keeps its own pools, one per world size, so ``-k``,
``--junitxml`` and ``-n`` work as on any suite.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import tempfile
import time
from pathlib import Path

import pytest

RUN = pytest.StashKey["SuiteRun"]()


def suite_file(file_path: Path, parent: pytest.Collector, suite: str) -> pytest.Collector | None:
    """The collector of ``suite``'s items, where ``file_path`` is that module's file."""
    if file_path.suffix != ".py" or _origin(suite) != file_path.resolve():
        return None
    return SuiteFile.from_parent(parent, path=file_path, suite=suite)


@functools.cache  # asked for every file pytest collects
def _origin(suite: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(suite)
    except (ImportError, ValueError):
        return None
    return None if spec is None or spec.origin is None else Path(spec.origin).resolve()


class SuiteFile(pytest.File):
    def __init__(self, *, suite: str, **kwargs):
        super().__init__(**kwargs)
        self.suite = suite

    def collect(self):
        from tpdp_verify.runner.gate import searches
        from tpdp_verify.runner.selection import search_id, select
        from tpdp_verify.runner.suite import load

        run = self.config.stash[RUN]
        every = searches(load(self.suite).properties, run.profile)
        mine = set(select([(p.name, ws) for p, ws in every], None, run.shard or None, run.profile))
        for prop, world_size in every:
            if (prop.name, world_size) not in mine:
                continue  # another part's (--tpdp-shard), as gate --shard leaves it
            yield Search.from_parent(self, name=search_id(prop.name, world_size), prop=prop, world_size=world_size)


class SearchFailed(Exception):
    """A search with a blocking finding, or no verdict: its outcome says which."""

    def __init__(self, outcome):
        super().__init__(outcome.status)
        self.outcome = outcome


class Search(pytest.Item):
    """One search of the suite: a property on a pool of ``world_size`` ranks."""

    def __init__(self, *, prop, world_size: int, **kwargs):
        super().__init__(**kwargs)
        self.prop, self.world_size = prop, world_size

    def runtest(self) -> None:
        outcome = self.config.stash[RUN].search(self.prop, self.world_size)
        known = [f.kind for f in outcome.findings if f.status == "known"]
        if known:
            self.user_properties.append(("known", "; ".join(known)))
        if outcome.status not in ("pass", "known"):
            raise SearchFailed(outcome)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, SearchFailed):
            from tpdp_verify.runner.gate import outcome_report

            return outcome_report(excinfo.value.outcome)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, self.name


class SuiteRun:
    """A pytest process's share of a gate run, from the plugin's options: its pools, the
    baseline, and the shrinking and rerun budgets the gate spends over all its searches."""

    def __init__(self, profile: str, impl: str, backend: str, timeout: str, baseline: str, seed: str,
                 shard: str, rank_output: bool):
        from tpdp_verify.errors import UsageError
        from tpdp_verify.runner import profiles, selection

        self.profile = profiles.get(profile)
        if seed and not seed.lstrip("-").isdigit():
            raise UsageError(f"--tpdp-seed takes a whole number, not {seed!r}")
        self.profile = dataclasses.replace(self.profile, seed=int(seed)) if seed else self.profile
        self.shard = shard and "{}/{}".format(*selection.parse(shard))  # refused now, not at collection
        self.impl, self.backend, self.timeout, self.baseline = impl, backend, float(timeout), baseline
        self.rank_output = rank_output
        self.shrunk = self.reran = 0.0

    @functools.cached_property
    def pools(self):
        from tpdp_verify.ranks.pool import Pools

        return Pools(self.backend, self.timeout, tempfile.mkdtemp(prefix="tpdp-verify-ranks-") if self.rank_output
                     else None)

    @functools.cached_property
    def entries(self):
        from tpdp_verify.runner import baseline

        return baseline.load(self.baseline)[1] if self.baseline else None

    def search(self, prop, world_size: int):
        from tpdp_verify.runner import baseline
        from tpdp_verify.runner.gate import check_property, rerunner

        profile = self.profile.with_shrinking_left(self.profile.shrink_total - self.shrunk)
        known = None if self.entries is None else baseline.regional_parts(self.entries).get(prop.name, {})
        outcome = check_property(prop, self.pools.get(world_size), self.impl, profile, known=known)
        self.shrunk += outcome.stats.shrink_seconds
        if self.entries is not None:  # the whole file, as the gate judges: what one world size recorded in a
            start = time.monotonic()  # region is known at the others too; the others' entries are "not run" here
            with rerunner((prop,), self.impl, self.backend, self.timeout) as rerun:
                baseline.judge([outcome], self.entries, rerun, max(0.0, self.profile.rerun_total - self.reran),
                               self.timeout)
            self.reran += time.monotonic() - start
        return outcome

    def close(self) -> None:
        if "pools" in self.__dict__:
            self.pools.close()
