"""What an implementation under test returned, looked at without trusting it.

A structural property's checks read what the implementation's functions return. Whatever
comes back (None, a bare tensor where a pair belongs, a tuple of the wrong length, an
object that raises when touched) must become a failed check that says what it was: an
exception raised in the harness's own check code is no finding (tpdp_verify.signature)
and the gate would stop on it as its internal error, with no case and no replay. These
helpers never let a returned value's own code raise through them.
"""

from __future__ import annotations


def is_a(value, cls) -> bool:
    """isinstance, False for a value that raises when asked (its ``__class__``)."""
    try:
        return isinstance(value, cls)
    except Exception:  # noqa: BLE001 - such a value is no instance of anything the contract names
        return False


def items(value) -> tuple | None:
    """A tuple's or list's items, read by tuple's and list's own methods (not a subclass's
    overrides); None for anything else."""
    for base in (tuple, list):
        if is_a(value, base):
            return tuple(base.__getitem__(value, i) for i in range(base.__len__(value)))
    return None


def unpacked(value, n: int) -> tuple | None:
    """``value``'s items when it is a tuple or list of ``n``, else None."""
    got = items(value)
    return got if got is not None and len(got) == n else None


def kind(value) -> str:
    """What came back, for a detail: its type, and a tuple's or list's items' types."""
    got = items(value)
    if got is None:
        return type(value).__name__
    inner = ", ".join(type(v).__name__ for v in got[:4]) + (", ..." if len(got) > 4 else "")
    return f"{type(value).__name__}({inner})"


def shown(value, limit: int = 300) -> str:
    """``repr(value)`` for a detail, or what repr raised."""
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - the detail says so instead
        return f"a {type(value).__name__} whose repr raises {type(exc).__name__}"
    return text if len(text) <= limit else text[:limit] + "..."


def read(value, attr: str):
    """``value.attr``, or text saying what reading it raised: comparable, never equal to
    what a well-formed value holds."""
    try:
        return getattr(value, attr)
    except Exception as exc:  # noqa: BLE001 - the comparison that reads it fails instead
        return f"<{type(value).__name__}.{attr} raises {type(exc).__name__}>"
