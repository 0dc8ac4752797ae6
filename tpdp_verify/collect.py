"""The conformance suite as pytest items: ``pytest --pyargs tpdp_verify.properties``.

One item per property and world size of the profile (``trains_like_one_device[world_size=2]``),
run by the gate's own runner: the same sequence (``judged_search``: the search, each
failure judged by the baseline release on its case, the memo's cases rerun), reported with
the same text, signature and replay. An item passes, passes with its known faults listed
(``known`` in its JUnit properties), or fails with the report the CLI prints. Each pytest
process (a pytest-xdist worker too) keeps its own pools, one per world size, so ``-k``,
``--junitxml`` and ``-n`` work as on any suite.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
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
        from tpdp_verify.status import Found

        known = [f.kind + (f" ({f.explanation.line()})" if f.explanation else "")
                 for f in outcome.findings if f.status == Found.KNOWN]
        if known:
            self.user_properties.append(("known", "; ".join(known)))
        if not outcome.status.green:  # as the gate's exit code and its JUnit file (tpdp_verify.status)
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
        if baseline:
            from tpdp_verify.runner.baseline import release_of

            release_of(baseline)  # refused now, not at the first search
        self.rank_output = rank_output
        from tpdp_verify.runner.gate import Spent

        self.spent = Spent()  # the profile's shrinking and rerun budgets, over this process's searches

    @functools.cached_property
    def pools(self):
        from tpdp_verify.ranks.pool import Pools

        from tpdp_verify.files import run_directory

        return Pools(self.backend, self.timeout, run_directory() if self.rank_output else None)

    @functools.cached_property
    def release(self):
        """The baseline release, where one is named: its memo, and its side started on first use."""
        from tpdp_verify.runner.baseline import Baseline, release_of

        return Baseline(release_of(self.baseline), backend=self.backend, timeout=self.timeout) if self.baseline \
            else None

    def search(self, prop, world_size: int):
        from tpdp_verify.runner.gate import judged_search

        return judged_search(prop, self.pools.get(world_size), self.impl, self.profile, self.release, self.spent)

    def close(self) -> None:
        if "pools" in self.__dict__:
            self.pools.close()
        if self.__dict__.get("release") is not None:
            self.release.close()
