"""Toy properties that fail on purpose, cheaply (no ranks): for the gate's own bounds and
the baseline's bookkeeping, which real properties would make minutes long. A suite too:
``gate --suite toy_suite`` runs ALL."""

import time

from hypothesis import strategies as st

from tpdp_verify.judging.divergence import divergence
from tpdp_verify.runner.property import tpdp_property

SLOW = 0.02  # seconds a toy example takes: shrinking one failure costs a few tenths
RARE = 987_654_321  # a value no search of 0..10**12 draws, so only a recorded case shows its failure


def _fails_above_ten(n):
    time.sleep(SLOW)
    if n > 10:
        raise divergence(("check:toy-stays-small",))(f"n = {n} is above 10")


@tpdp_property(n=st.integers(0, 10_000))
def first(pool, impl, n):
    _fails_above_ten(n)


@tpdp_property(n=st.integers(0, 10_000))
def second(pool, impl, n):
    _fails_above_ten(n)


@tpdp_property(n=st.integers(0, 10**12))
def rare(pool, impl, n):
    """Fails below 100 (what every search meets) and, otherwise, only at RARE."""
    if n < 100:
        raise divergence(("check:toy-stays-large",))(f"n = {n} is below 100")
    if n == RARE:
        raise divergence(("check:toy-avoids-rare",))(f"n = {n} is the rare one")


def _say(n):
    import sys

    print(f"rank says n = {n}", file=sys.stderr, flush=True)


@tpdp_property(n=st.integers(0, 10_000))
def chatty(pool, impl, n):
    """Its ranks print (as torch's warnings would), then it fails as ``first`` does."""
    pool.run(_say, n)
    _fails_above_ten(n)


@tpdp_property(n=st.integers(0, 10_000))
def silent(pool, impl, n):
    pool.run(abs, n)


ALL = (rare,)
