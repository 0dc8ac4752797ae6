"""pytest plugin: rank pools, the implementation under test and the run profile as fixtures;
and the conformance suite as items (``pytest --pyargs tpdp_verify.properties``: tpdp_verify.collect).

Registered through the ``pytest11`` entry point; disable with ``-p no:tpdp_verify``.
Every option has an ini key of the same name (``--tpdp-world-size`` / ``tpdp_world_size``);
the command line wins.
"""

from __future__ import annotations

import math

import pytest

from tpdp_verify.ranks.pool import Pools, RankPool
from tpdp_verify.runner import profiles

OPTIONS = {
    "world_size": ("2", "ranks of the default pool (the tpdp marker may ask for others)"),
    "backend": ("auto", "process-group backend: auto (nccl with one GPU a rank, else gloo), gloo, nccl"),
    "impl": ("torch", "implementation under test: torch, reference or a dotted path"),
    "profile": ("ci", "run profile: smoke, ci or release"),
    "timeout": ("120", "seconds one check may take before its ranks count as hung"),
    "suite": ("tpdp_verify.properties", "the suite module collected as items, one a property and world size"),
    "baseline": ("", "the torch release whose faults are known, as pip spells it (torch==2.13.0): a failure is "
                 "known where it fails the same way there on the same case (tpdp-verify docs cli)"),
    "seed": ("", "draw other cases than the profile's fixed ones"),
    "shard": ("", "collect the K-th of N parts of the suite's searches (K/N), balanced by cost as gate --shard"),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tpdp-verify", "tensor parallel x data parallel verification")
    for key, (default, help) in OPTIONS.items():
        group.addoption(f"--tpdp-{key.replace('_', '-')}", dest=f"tpdp_{key}", default=None,
                        help=f"{help} (default: {default})")
        parser.addini(f"tpdp_{key}", help, default=default)


def pytest_configure(config: pytest.Config) -> None:
    from tpdp_verify.collect import RUN, SuiteRun
    from tpdp_verify.errors import UsageError

    try:  # the ranks' output (torch's warnings, gloo's logs) in files, as the gate keeps it, unless -s
        config.stash[RUN] = SuiteRun(*(_option(config, k) for k in ("profile", "impl", "backend", "timeout",
                                                                     "baseline", "seed", "shard")),
                                     rank_output=config.getoption("capture") != "no")
    except UsageError as exc:  # one line before collection, as the gate says it, not a traceback
        raise pytest.UsageError(f"tpdp-verify: {exc}") from None
    config.addinivalue_line(
        "markers",
        "tpdp(world_size=N, mesh=(dp, tp)): run the test on a pool of N ranks (default "
        "--tpdp-world-size, or dp * tp of the mesh); mesh is the default of tpdp.verify_plan",
    )


MARKER_KEYWORDS = ("world_size", "mesh")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A tpdp marker with a keyword it does not take (``world_sise=4``) would run the test on
    the default pool, silently: refused, in one line, before any test runs."""
    import difflib

    for item in items:
        for marker in item.iter_markers("tpdp"):
            wrong = [k for k in marker.kwargs if k not in MARKER_KEYWORDS]
            if marker.args or wrong:
                near = difflib.get_close_matches(wrong[0], MARKER_KEYWORDS, n=1) if wrong else []
                what = f"keyword {wrong[0]!r}" if wrong else f"positional argument {marker.args[0]!r}"
                raise pytest.UsageError(
                    f"tpdp-verify: {item.nodeid}: the tpdp marker takes no {what}"
                    + (f"; did you mean {near[0]!r}?" if near else "")
                    + f"; it takes {' and '.join(f'{k}=' for k in MARKER_KEYWORDS)}")


def pytest_collect_file(file_path, parent: pytest.Collector):
    from tpdp_verify.collect import suite_file

    return suite_file(file_path, parent, _option(parent.config, "suite"))


def pytest_unconfigure(config: pytest.Config) -> None:
    from tpdp_verify.collect import RUN

    if RUN in config.stash:
        config.stash[RUN].close()


def _option(config: pytest.Config, key: str) -> str:
    value = config.getoption(f"tpdp_{key}")
    return value if value is not None else config.getini(f"tpdp_{key}")


@pytest.fixture(scope="session")
def tpdp_pools(pytestconfig: pytest.Config):
    pools = Pools(_option(pytestconfig, "backend"), float(_option(pytestconfig, "timeout")))
    yield pools
    pools.close()


def _marked(request: pytest.FixtureRequest) -> tuple[int, tuple[int, ...] | None]:
    """The world size and mesh ((dp, tp) or (dp_replicate, dp_shard, tp)) the test's tpdp
    marker asks for, with the options' defaults."""
    marker = request.node.get_closest_marker("tpdp")
    kwargs = marker.kwargs if marker else {}
    mesh = tuple(kwargs["mesh"]) if kwargs.get("mesh") else None
    world_size = kwargs.get("world_size") or (math.prod(mesh) if mesh else _option(request.config, "world_size"))
    return int(world_size), mesh


@pytest.fixture
def tpdp_pool(request: pytest.FixtureRequest, tpdp_pools: Pools) -> RankPool:
    """A RankPool of the marker's world_size (or its mesh's), else --tpdp-world-size;
    shared by the session."""
    return tpdp_pools.get(_marked(request)[0])


class Tpdp:
    """What the ``tpdp`` fixture gives a test: verify_plan on the session's pool, failing
    the test with the report when the plan departs."""

    def __init__(self, pool: RankPool, impl: str, mesh: tuple[int, ...]):
        self.pool, self.impl, self.mesh = pool, impl, mesh

    def verify_plan(self, model_fn, plan=None, **kwargs):
        """tpdp_verify.verify_plan (a plan, or parallelize_fn=) with this test's pool, mesh
        and implementation; returns the Report when every check passes, else fails the test
        with it."""
        from tpdp_verify.errors import UsageError
        from tpdp_verify.plan import verify_plan

        kwargs.setdefault("mesh", self.mesh)
        kwargs.setdefault("impl", self.impl)
        try:
            report = verify_plan(model_fn, plan, pool=self.pool, **kwargs)
        except UsageError as exc:
            mistake = str(exc)  # failed outside the handler: no chained traceback
        else:
            mistake = ""
        if mistake:
            pytest.fail(f"tpdp-verify: {mistake}", pytrace=False)
        if not report.ok:
            pytest.fail(str(report), pytrace=False)
        return report


@pytest.fixture
def tpdp(request: pytest.FixtureRequest, tpdp_pool: RankPool, tpdp_impl: str) -> Tpdp:
    """``tpdp.verify_plan(model_fn, plan, input_fn=..., ...)``: see tpdp_verify.verify_plan.
    The mesh defaults to the marker's, else (1, world size) on 2 ranks, (2, world size / 2)
    on more."""
    world_size, mesh = _marked(request)
    if mesh is None:
        mesh = (2, world_size // 2) if world_size >= 4 and world_size % 2 == 0 else (1, world_size)
    return Tpdp(tpdp_pool, tpdp_impl, mesh)


@pytest.fixture(scope="session")
def tpdp_impl(pytestconfig: pytest.Config) -> str:
    """The name of the implementation under test, checked to import."""
    from tpdp_verify.impls.select import load

    return load(_option(pytestconfig, "impl")).name


@pytest.fixture(scope="session")
def tpdp_profile(pytestconfig: pytest.Config) -> profiles.Profile:
    return profiles.get(_option(pytestconfig, "profile"))
