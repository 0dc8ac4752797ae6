"""The oracles: the unsharded model on one device (single_device), and the case's own DP
entry point without TP (plain_ddp); verdicts judges a TP+DP case against each."""

from tpdp_verify.errors import PoolError, RankFailed


def aside(fn, *args):
    """``fn(*args)``, a run made to explain a failure (naming its first module, running it
    without TP), and the line saying why it gave nothing ("" when it did). What such a run
    meets (a rank that dies or hangs, an exception) never becomes the case's finding: which
    failures get explained depends on what a baseline knows, and a case's signature must not."""
    try:
        return fn(*args), ""
    except (PoolError, RankFailed) as exc:
        return None, f"could not be run: {str(exc).splitlines()[0]}"
