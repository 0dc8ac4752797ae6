"""Judging what the ranks observed: every check counted, every failure named."""

from __future__ import annotations

from typing import NamedTuple

from tpdp_verify import signature


class Check(NamedTuple):
    """One comparison made on one rank.

    ``name`` says what is checked and is the check's identifier in signatures and
    baselines; ``detail`` says what was seen, for readers. ``part`` overrides the
    signature part, for a check that failed by an exception (its type and frame).
    """

    name: str
    ok: bool
    detail: str = ""
    part: str = ""

    @property
    def signature_part(self) -> str:
        return self.part or signature.check(self.name)


def assert_checks(per_rank: list[list[Check]], minimum: int = 1) -> int:
    """Raise a Divergence (an AssertionError) naming each failed check and its ranks; return the count.

    A run that compared fewer than ``minimum`` items fails too: a check that compared
    nothing cannot have found anything.
    """
    compared = sum(len(checks) for checks in per_rank)
    if compared < minimum:
        raise AssertionError(f"compared {compared} items, expected at least {minimum}")
    failed: dict[str, tuple[list[int], str]] = {}
    parts = []
    for rank, checks in enumerate(per_rank):
        for check in checks:
            if not check.ok:
                parts.append(check.signature_part)
                ranks, _ = failed.setdefault(check.name, ([], check.detail))
                if rank not in ranks:
                    ranks.append(rank)
    if failed:
        from tpdp_verify.verdict import divergence  # verdict builds on Check: imported late

        lines = [
            f"  {name} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}): {detail}"
            for name, (ranks, detail) in failed.items()
        ]
        # Typed by everything that failed, so hypothesis shrinks distinct departures apart
        # and a baseline tells them apart (tpdp_verify.baseline).
        raise divergence(signature.of(parts))(
            f"{len(failed)} of {compared // len(per_rank)} checks failed:\n" + "\n".join(lines)
        )
    return compared
