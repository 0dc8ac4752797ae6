"""pytest plugin: rank pools, the implementation under test and the run profile as fixtures.

Registered through the ``pytest11`` entry point; disable with ``-p no:tpdp_verify``.
Every option has an ini key of the same name (``--tpdp-world-size`` / ``tpdp_world_size``);
the command line wins.
"""

from __future__ import annotations

import pytest

from tpdp_verify import profiles
from tpdp_verify.pool import RankPool

OPTIONS = {
    "world_size": ("2", "ranks of the default pool (the tpdp marker may ask for others)"),
    "backend": ("auto", "process-group backend: auto (nccl with one GPU a rank, else gloo), gloo, nccl"),
    "impl": ("torch", "implementation under test: torch, reference or a dotted path"),
    "profile": ("ci", "run profile: smoke, ci or release"),
    "timeout": ("120", "seconds one check may take before its ranks count as hung"),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tpdp-verify", "tensor parallel x data parallel verification")
    for key, (default, help) in OPTIONS.items():
        group.addoption(f"--tpdp-{key.replace('_', '-')}", dest=f"tpdp_{key}", default=None,
                        help=f"{help} (default: {default})")
        parser.addini(f"tpdp_{key}", help, default=default)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "tpdp(world_size=N, mesh=(dp, tp)): run the test on a pool of N ranks (default "
        "--tpdp-world-size); mesh is the shape the test's checks use",
    )


def _option(config: pytest.Config, key: str) -> str:
    value = config.getoption(f"tpdp_{key}")
    return value if value is not None else config.getini(f"tpdp_{key}")


class Pools:
    """The session's pools, one per world size, started on first use."""

    def __init__(self, backend: str, timeout: float):
        self.backend, self.timeout = backend, timeout
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size, self.backend, timeout=self.timeout)
        return self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


@pytest.fixture(scope="session")
def tpdp_pools(pytestconfig: pytest.Config):
    pools = Pools(_option(pytestconfig, "backend"), float(_option(pytestconfig, "timeout")))
    yield pools
    pools.close()


@pytest.fixture
def tpdp_pool(request: pytest.FixtureRequest, tpdp_pools: Pools) -> RankPool:
    """A RankPool of the marker's world_size, else --tpdp-world-size; shared by the session."""
    marker = request.node.get_closest_marker("tpdp")
    world_size = marker.kwargs.get("world_size") if marker else None
    return tpdp_pools.get(int(world_size or _option(request.config, "world_size")))


@pytest.fixture(scope="session")
def tpdp_impl(pytestconfig: pytest.Config) -> str:
    """The name of the implementation under test, checked to import."""
    from tpdp_verify.impl import load

    return load(_option(pytestconfig, "impl")).name


@pytest.fixture(scope="session")
def tpdp_profile(pytestconfig: pytest.Config) -> profiles.Profile:
    return profiles.get(_option(pytestconfig, "profile"))
