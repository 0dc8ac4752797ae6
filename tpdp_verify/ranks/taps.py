"""Taps: tpdp-verify's functions that run inside torch's own calls, to note what passes.

A tap wraps a function torch calls (a ``loss_parallel`` handler, FSDP2's step that hands
TP's partial gradients to its reduction, FSDP2's reduction over dp) and calls it
unchanged. An exception raised beneath one is torch's: tpdp_verify.signature reads this
file's frames as the call's own (as it does contextlib's), so a tap never moves a fault's
signature.
"""

from __future__ import annotations

import contextlib


def noting(op, handler, seen: set[str]):
    """``handler`` of ``op``, adding the op's name to ``seen`` each time it runs."""

    def handle(*args, **kwargs):
        seen.add(op._schema.name.removeprefix("aten::"))
        return handler(*args, **kwargs)

    return handle


def watching(inner, partial_of, record):
    """``inner(fsdp_param, grad)``, calling ``record(fsdp_param, partial, result)`` where
    ``partial_of(grad)`` gives the gradient's partial local tensor (None: not partial)."""

    def watched(fsdp_param, grad):
        partial = partial_of(grad)
        out = inner(fsdp_param, grad)
        if partial is not None:
            record(fsdp_param, partial, out)
        return out

    return watched


def around(inner, before, after):
    """``inner`` called unchanged, ``before(*args, **kwargs)`` first and ``after(what it
    returned)`` once ``inner`` has returned."""

    def tapped(*args, **kwargs):
        noted = before(*args, **kwargs)
        out = inner(*args, **kwargs)
        after(noted)
        return out

    return tapped


@contextlib.contextmanager
def replaced(owner, name: str, wrap):
    """``owner.name`` replaced by ``wrap(its value)`` for the run, put back after it."""
    inner = getattr(owner, name)
    setattr(owner, name, wrap(inner))
    try:
        yield
    finally:
        setattr(owner, name, inner)
