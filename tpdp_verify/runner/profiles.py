"""The three run profiles: how many examples, on which world sizes.

Each is also registered as a hypothesis settings profile named ``tpdp-<name>`` (prefixed
so that a project's own ``ci`` profile is left alone). All are derandomized with no
example database: the same torch build gets the same verdict on every machine, and a
failure printed by CI replays locally.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, settings

from tpdp_verify.errors import UsageError


@dataclass(frozen=True)
class Profile:
    name: str
    max_examples: int
    world_sizes: tuple[int, ...]
    shrink: bool = True  # False: stop at the first failing example (how fast is a fault found)
    budget: float = 0.0  # seconds a gate run should take on a 2-core machine, pool start included
    seed: int | None = None  # None: each property's own fixed seed (derandomized); else this one
    shrink_seconds: int = 300  # the most a property's run spends shrinking (hypothesis's own cap: 300)
    # the most a whole gate run spends shrinking: once spent, later properties report each
    # failure as first found. A build that breaks many properties (a crash in a path every
    # case takes) would otherwise spend shrink_seconds on each, twice.
    shrink_total: float = 1200
    # the most a gate spends rerunning the memo's failing cases its searches did not meet (to
    # tell FIXED and CHANGED); those left are counted as not rerun
    rerun_total: float = 600

    def with_shrinking_left(self, seconds: float) -> "Profile":
        """This profile for a run that may spend only ``seconds`` more shrinking."""
        if seconds <= 0:
            return dataclasses.replace(self, shrink=False)
        return dataclasses.replace(self, shrink_seconds=min(self.shrink_seconds, max(1, int(seconds))))

    @property
    def settings(self) -> settings:
        registered = settings(settings.get_profile(f"tpdp-{self.name}"), max_examples=self.max_examples)
        if self.shrink:
            return registered
        return settings(registered, phases=[Phase.explicit, Phase.reuse, Phase.generate])


PROFILES = {
    p.name: p
    for p in (
        # smoke reports each property's first new failure unshrunk: with failures told apart
        # by signature, shrinking every one the search meets took minutes, not one
        Profile("smoke", max_examples=10, world_sizes=(2,), shrink=False, budget=60, rerun_total=15),
        # ci: the search alone takes about 250 s of its 300 on 2 cores against torch 2.13.0;
        # shrinking and replays get what is left, so a run with new findings still ends in time
        Profile("ci", max_examples=40, world_sizes=(2, 4), budget=300, shrink_seconds=30, shrink_total=45,
                rerun_total=30),
        # release: the search alone takes about 2600 s on 2 cores against torch 2.13.0 (53
        # searches; costs.json), a quarter of it in each of 4 shards; shrinking, replays and
        # reruns are bounded so that a run with new findings still ends within the hour
        Profile("release", max_examples=200, world_sizes=(2, 4, 8), budget=3600, shrink_total=600,
                rerun_total=120),
    )
}

for _p in PROFILES.values():
    settings.register_profile(
        f"tpdp-{_p.name}",
        max_examples=_p.max_examples,
        derandomize=True,
        database=None,
        deadline=None,  # ranks share two cores: wall time says nothing about a bug
        print_blob=False,  # the gate prints a replay script; the blob fits no user's test
        suppress_health_check=[HealthCheck.too_slow],
    )


def get(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise UsageError(
            f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}"
        ) from None
