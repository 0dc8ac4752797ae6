"""Which implementation of the TP->DP transform is under test.

``load("torch")`` (the default) binds torch's private functions, ``load("reference")``
binds tpdp_verify.impls.transform, and any other name is a dotted path to a module, or to an
object in a module (a class is instantiated), that defines the same functions under the
names in ``FUNCTIONS`` (torch's names without the leading underscore): a patched torch, a
user's own transform, or a subclass of ``tpdp_verify.impls.transform.Transform``. Ranks
load the implementation by name, so it must import there too.
"""

from __future__ import annotations

import contextlib
import importlib
from types import SimpleNamespace
from typing import Callable

from tpdp_verify.errors import UsageError

FUNCTIONS = (
    "flatten_tensor",
    "unflatten_tensor",
    "get_submodule_n_params",
    "update_module_param",
    "localize_dtensor",
    "reconstruct_dtensor",
    "pre_dp_module_transform",
)


def _torch() -> SimpleNamespace:
    from torch.distributed.tensor.parallel import _data_parallel_utils as dpu
    from torch.distributed.tensor.parallel import ddp

    functions = {f: getattr(ddp, f"_{f}", None) or getattr(dpu, f"_{f}") for f in FUNCTIONS}
    return SimpleNamespace(name="torch", **functions)


def _resolve(path: str):
    """Import ``pkg.mod`` or ``pkg.mod.Object``."""
    try:
        return importlib.import_module(path)
    except ImportError as first:
        module_name, _, attr = path.rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError, ValueError):
            raise first from None


def load(name: str = "torch") -> SimpleNamespace:
    """The functions of implementation ``name``; a clear UsageError if it cannot be used."""
    if name == "torch":
        return _torch()
    return _load(name, "implementation", FUNCTIONS, "tpdp_verify.impls.transform",
                 "tpdp_verify.impls.transform.Transform", "tpdp_verify.impls.fsdp_extension.FSDPExtension",
                 _torch, FSDP_FUNCTIONS)


# Where torch's DP entry points look the transform up: DDP(device_mesh=...) and replicate
# import from ``ddp`` when called, FSDP1's DTensorExtensions bound the two tensor functions
# at import. Installing an implementation points all of them at it.
_SITES = {
    "torch.distributed.tensor.parallel.ddp": FUNCTIONS,
    "torch.distributed.tensor.parallel._data_parallel_utils": ("flatten_tensor", "unflatten_tensor"),
    "torch.distributed.tensor.parallel.fsdp": ("flatten_tensor", "unflatten_tensor"),
}


def _at_site(module_name: str, f: str, implementation: SimpleNamespace):
    """``implementation``'s function ``f`` as torch's call site in ``module_name`` calls it.

    FSDP1's DTensorExtensions call ``_unflatten_tensor(t, spec, device_handle=...,
    compute_stream=...)``: stream bookkeeping for CUDA that is not part of the transform's
    contract, so an implementation under test is called without it.
    """
    fn = getattr(implementation, f)
    if module_name.endswith(".fsdp") and f == "unflatten_tensor":
        return lambda tensor, info, **_streams: fn(tensor, info)
    return fn


@contextlib.contextmanager
def installed(implementation: SimpleNamespace):
    """Make torch's DP entry points call ``implementation``'s transform, inside a rank; and
    enter its ``patched()``, where it has one (a patched torch beyond the transform: what
    the run around the transform calls, such as loss_parallel's handlers), for the run."""
    if implementation.name == "torch":
        yield
        return
    importlib.import_module("torch.distributed.fsdp")  # which imports parallel.fsdp without a cycle
    saved = []
    try:
        for module_name, names in _SITES.items():
            module = importlib.import_module(module_name)
            for f in names:
                saved.append((module, f"_{f}", getattr(module, f"_{f}")))
                setattr(module, f"_{f}", _at_site(module_name, f, implementation))
        with getattr(implementation, "patched", contextlib.nullcontext)():
            yield
    finally:
        for module, attr, value in reversed(saved):
            setattr(module, attr, value)


# -- FSDP1's tensor-parallel extension (DTensorExtensions) -----------------------------

FSDP_FUNCTIONS = (
    "pre_flatten_transform",
    "post_unflatten_transform",
    "chunk_tensor",
    "chunk_dtensor",
    "pre_load_state_dict_transform",
    "all_gather_dtensor",
)


def load_fsdp(name: str = "torch", device_type: str = "cpu") -> SimpleNamespace:
    """The FSDP extension functions of implementation ``name``, as ``load`` does for the
    transform: ``torch`` binds a ``DTensorExtensions`` as FSDP1 builds it on the rank's
    device (``device_type``: tpdp_verify.ranks.pool.device_type() in a rank), ``reference``
    binds tpdp_verify.impls.fsdp_extension.FSDPExtension, any other name is a dotted path to
    a module or object (a class is instantiated) defining FSDP_FUNCTIONS."""
    if name == "torch":
        import torch
        from torch.distributed.fsdp._common_utils import _FSDPDeviceHandle
        from torch.distributed.tensor.parallel.fsdp import DTensorExtensions

        ext = DTensorExtensions(_FSDPDeviceHandle.from_device(torch.device(device_type)))
        return SimpleNamespace(name="torch", **{f: getattr(ext, f) for f in FSDP_FUNCTIONS})
    reference = "tpdp_verify.impls.fsdp_extension.FSDPExtension"
    return _load(name, "FSDP extension", FSDP_FUNCTIONS, reference, reference, "tpdp_verify.impls.transform.Transform",
                 lambda: load_fsdp("torch", device_type), FUNCTIONS)


def _count_under_test(source) -> None:
    """The module an implementation lives in is code under test: a fault raised there is
    named by it (tpdp_verify.signature), as torch's are by torch's."""
    import inspect

    from tpdp_verify import signature

    module = inspect.getmodule(source)
    if module is not None and getattr(module, "__file__", None):
        signature.under_test(module.__file__)


def _load(name: str, what: str, functions: tuple[str, ...], reference: str, reference_class: str,
          sibling_class: str, torchs: Callable[[], SimpleNamespace], siblings: tuple[str, ...]) -> SimpleNamespace:
    """``functions`` of ``name`` (``reference`` for "reference", else a dotted path; a class
    is instantiated). A variant of the other family's reference (``sibling_class``: a
    mutant of it) keeps this family's reference (``reference_class``) for what it lacks;
    an implementation of the other family only (all of ``siblings``, none of ``functions``:
    a patched torch transform) keeps torch's (``torchs``)."""
    try:
        source = _resolve(reference if name == "reference" else name)
    except ImportError as exc:
        raise UsageError(
            f"{what} {name!r} does not import ({exc}); give torch, reference or an importable dotted path"
        ) from None
    _count_under_test(source)
    if isinstance(source, type):
        source = source()
    missing = [f for f in functions if not callable(getattr(source, f, None))]
    if missing and isinstance(source, _resolve(sibling_class)):
        return _with(name, functions, source, _resolve(reference_class)())
    if len(missing) == len(functions) and all(callable(getattr(source, f, None)) for f in siblings):
        return SimpleNamespace(**{**vars(torchs()), "name": name})
    if missing:
        raise UsageError(
            f"{what} {name!r} lacks {', '.join(missing)}; it must define all of "
            f"{', '.join(functions)} (see {reference_class.rpartition('.')[0].replace('.', '/')}.py)"
        )
    loaded = SimpleNamespace(name=name, **{f: getattr(source, f) for f in functions})
    if callable(getattr(source, "patched", None)):
        loaded.patched = source.patched
    return loaded


def _with(name: str, functions: tuple[str, ...], source, fallback) -> SimpleNamespace:
    """``functions`` from ``source`` where it defines them, else from ``fallback``."""
    return SimpleNamespace(name=name, **{f: getattr(source, f, None) if callable(getattr(source, f, None))
                                         else getattr(fallback, f) for f in functions})
