"""The shipped memo answers its own draws: every case the fixed draws of smoke, ci and release
run, at each world size, cover cases included, is answered by
tpdp_verify/memos/torch-2.13.0.json.gz, pass or fail, so that a gate against torch 2.13.0
replays none of them. A search is made dry:
the suite's own strategies and hypothesis's fixed seeds, every case answered "known" (as the
release's own run is judged), nothing run on ranks; a change of the case space that moves a
draw fails here, naming the property and the command that records its answers again."""

import pytest

from tpdp_verify.judging.divergence import divergence
from tpdp_verify.runner import memo as memos
from tpdp_verify.runner import profiles
from tpdp_verify.runner.gate import searches
from tpdp_verify.runner.property import Stats
from tpdp_verify.runner.suite import load
from tpdp_verify.status import Found

RELEASE = "2.13.0"
RECORD = (f"tpdp-verify gate --profile {{profile}} --baseline torch=={RELEASE} "
          f"--memo tpdp_verify/memos/torch-{RELEASE}.json.gz")
RECORDED = ("smoke", "ci", "release")  # release's draw: over an hour to record here, 30 s to draw dry
Dry = divergence(("check:dry-search",))


class DryPool:
    """A pool that runs nothing: the first call raises, as a known failure would."""

    backend = "gloo"

    def __init__(self, world_size: int):
        self.world_size = world_size

    def run(self, fn, *args, **kwargs):
        raise Dry("a dry search runs nothing")


@pytest.fixture(scope="module")
def shipped():
    return memos.Memo.load(RELEASE, [memos.shipped(RELEASE)])


SEARCHES = [(name, prop, ws) for name in RECORDED
            for prop, ws in searches(load("tpdp_verify.properties").properties, profiles.get(name))]


@pytest.mark.parametrize("profile,prop,world_size", SEARCHES,
                         ids=[f"{n}-{p.name}-world{ws}" for n, p, ws in SEARCHES])
def test_the_shipped_memo_answers_every_fixed_draw(shipped, profile, prop, world_size):
    stats = Stats()
    prop.run(DryPool(world_size), "torch", profiles.get(profile), stats, lambda sig, drawn: Found.KNOWN)
    assert stats.ran and stats.passed == 0 and stats.known == stats.examples - stats.discarded, stats  # ran nothing
    missing = [k for k in stats.ran if k not in shipped.answers]
    assert not missing, (f"{len(missing)} of the {len(stats.ran)} cases {prop.name} runs at world size {world_size} "
                         f"({profile}) are not in the shipped memo: record them with "
                         f"`{RECORD.format(profile=profile)}`")
