"""A departure from an oracle, as an exception typed by its signature."""

from __future__ import annotations

from tpdp_verify import signature


class Divergence(AssertionError):
    """TP+DP departs from an oracle.

    Each signature (tpdp_verify.signature: everything that failed) raises a subclass of
    its own: hypothesis tells bugs apart by the exception's type, so distinct departures
    are each shrunk and reported instead of the simplest one hiding the rest, and a
    baseline knows a failure only when it knows every part of it.
    """

    signature: signature.Signature = ()
    kinds: tuple[str, ...] = ()  # each part of the signature as a reader says it
    kind = "departs from the oracle"  # the same, in one line


_KINDS: dict[signature.Signature, type[Divergence]] = {}


def divergence(parts: signature.Signature) -> type[Divergence]:
    """The Divergence subclass for a signature, named after its parts:
    ("check:every-rank-trains", "value:gradient") -> EveryRankTrains+GradientBeyondItsBound."""
    parts = signature.of(parts)
    if parts not in _KINDS:
        name = "+".join(signature.name(p) for p in parts) or "Diverges"
        kinds = tuple(signature.describe(p) for p in parts)
        _KINDS[parts] = type(name, (Divergence,), {"signature": parts, "kinds": kinds, "kind": " + ".join(kinds),
                                                   "__module__": __name__})
    return _KINDS[parts]
