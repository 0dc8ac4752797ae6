"""Mutants of torch's own TP->DP transform (torch/distributed/tensor/parallel/ddp.py and
_data_parallel_utils.py), each the way a real regression in torch would change it.

Each class is an implementation under test (``--impl torch_mutants.Name`` with tests/ on
sys.path, as tests/mutants.py is used, or ``tests.torch_mutants.Name`` from the repository
root): an instance exposes every function in ``tpdp_verify.impls.select.FUNCTIONS``, torch's own
function object for all but one. ``impl.installed`` points torch's call sites (ddp's and
_data_parallel_utils' module globals) at the instance's functions, so torch's unchanged
``_reconstruct_dtensor``, ``_localize_dtensor`` and ``_pre_dp_module_transform``, which
look ``_unflatten_tensor``, ``_flatten_tensor``, ``_update_module_param``... up in ddp's
globals when called, reach the changed one.

``caught_by`` names the properties expected to catch a mutant; ``departs_as`` the kinds
(verdict exception types, or the pool error) they report beyond torch 2.13.0's known
divergences (docs/known-divergences.md).
"""

from __future__ import annotations

import contextlib
import sys
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import _data_parallel_utils as _dpu
from torch.distributed.tensor.parallel import ddp as _ddp

from tpdp_verify.impls.select import FUNCTIONS


def _torch_originals() -> dict:
    """torch's own function objects, read where torch defines them. Taken when this module
    is imported, which is before ``installed`` patches anything in the ranks; refuse to
    start from an already patched site rather than mutate a mutant."""
    found = {f: getattr(_ddp, f"_{f}", None) or getattr(_dpu, f"_{f}") for f in FUNCTIONS}
    for f, fn in found.items():
        if not getattr(fn, "__module__", "").startswith("torch.distributed.tensor.parallel"):
            raise RuntimeError(f"torch's _{f} is patched ({fn!r}): import torch_mutants outside installed()")
    return found


_TORCH = _torch_originals()


class TorchReference:
    """torch's transform, unchanged, installed through the same sites as the mutants: the
    control (on torch 2.13.0 it shows only the known divergences)."""

    caught_by: frozenset = frozenset()
    departs_as: frozenset = frozenset()

    def __init__(self):
        for f in FUNCTIONS:
            if not _overrides(type(self), f):
                setattr(self, f, _TORCH[f])


def _overrides(cls: type, f: str) -> bool:
    """Whether a subclass of TorchReference defines ``f``."""
    return any(f in vars(c) for c in cls.__mro__ if c is not TorchReference and issubclass(c, TorchReference))


def _edited(function, old: str, new: str):
    """``function`` compiled again from torch's source with ``old`` replaced by ``new`` (found
    once), in its own module's globals, undecorated: a one-line edit, as a commit would make
    it, installed where the mutant puts it."""
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(function))
    source = source[source.index(f"def {function.__name__}("):]  # its decorators (a registration) not run again
    if source.count(old) != 1:
        raise RuntimeError(f"{function.__qualname__}'s source has {source.count(old)} of {old!r}: torch moved on")
    scope: dict = {}
    exec(compile(source.replace(old, new), inspect.getsourcefile(function), "exec"), function.__globals__, scope)
    return scope[function.__name__]


# -- (a) gradient values only -----------------------------------------------------------


def _sync_grad_hook_scaling(grad, *, device_handle=None, compute_stream=None):
    """torch's sync_grad_hook, returning the waited gradient times 1 + 1e-3: a stray factor
    (a leftover loss-scale ratio, a pre-division by the wrong degree) of the size a
    regression in a hook leaves, well inside what a loss curve would show."""
    return _dpu.sync_grad_hook(grad, device_handle=device_handle, compute_stream=compute_stream) * (1 + 1e-3)


class SyncGradHookScales(TorchReference):
    """``_unflatten_tensor``'s ``sync_grad_hook`` returns the gradient scaled by 1 + 1e-3.

    Every DDP+TP forward reconstructs the DTensors through ``_unflatten_tensor`` (torch's
    ``_reconstruct_dtensor``, unchanged, finds it in ddp's globals), which registers the
    hook on the local shard DDP reduces: every TP parameter's gradient, and only the
    gradient values, are off by 1e-3 relative; shapes, placements, registry unchanged.
    """

    caught_by = frozenset({"trains_like_one_device", "trains_like_plain_ddp"})
    departs_as = frozenset({"GradientBeyondItsBound"})

    @staticmethod
    def unflatten_tensor(tensor, spec, *, device_handle=None, compute_stream=None):
        return _unflatten(tensor, spec, _sync_grad_hook_scaling, device_handle, compute_stream)


def _unflatten(tensor, spec, hook, device_handle, compute_stream):
    """torch's ``_unflatten_tensor`` with ``hook`` in place of its ``sync_grad_hook``."""
    result = DTensor.from_local(tensor, spec.mesh, spec.placements, run_check=False,
                                shape=spec.shape, stride=spec.stride)
    if tensor.requires_grad:
        tensor.register_hook(partial(hook, device_handle=device_handle, compute_stream=compute_stream))
    return result


def _from_fsdp1() -> bool:
    """Whether the transform is being called by FSDP1's DTensorExtensions (its
    post_unflatten_transform), not by DDP's transform."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            return False
        if frame.f_code.co_name == "post_unflatten_transform":
            return True
        frame = frame.f_back
    return False


class FSDP1GradScales(TorchReference):
    """``_unflatten_tensor``'s hook scales the gradient by 1 + 1e-3 only where FSDP1's
    DTensorExtensions rebuild the DTensor: FSDP1 + TP training departs in its gradients alone,
    DDP's transform is torch's. On torch 2.13 another entry point (replicate, on the tied
    model) departs in gradients too: a baseline that knew parts anywhere filed this under
    that; one that knows by region reports it NEW."""

    caught_by = frozenset({"entry_points_train_like_one_device"})
    departs_as = frozenset({"GradientBeyondItsBound"})

    @staticmethod
    def unflatten_tensor(tensor, spec, *, device_handle=None, compute_stream=None):
        hook = _sync_grad_hook_scaling if _from_fsdp1() else _dpu.sync_grad_hook
        return _unflatten(tensor, spec, hook, device_handle, compute_stream)


def _sync_grad_hook_scaling_half(grad, *, device_handle=None, compute_stream=None):
    """torch's sync_grad_hook, times 1.05 for a bfloat16 gradient: a stray factor that a
    half-precision path alone takes (a loss scale left in a bfloat16 cast)."""
    waited = _dpu.sync_grad_hook(grad, device_handle=device_handle, compute_stream=compute_stream)
    return waited * 1.05 if waited.dtype == torch.bfloat16 else waited


class BFloat16GradScales(TorchReference):
    """``_unflatten_tensor``'s hook scales bfloat16 gradients by 1.05, float32 ones not at
    all: 1.05 is 6 units of a bfloat16's last place, inside the 32 units of the max bound,
    so only the whole-tensor comparison of half-precision gradients sees it (docs/tolerance.md)."""

    caught_by = frozenset({"trains_like_one_device"})
    departs_as = frozenset({"GradientBeyondItsBound"})

    @staticmethod
    def unflatten_tensor(tensor, spec, *, device_handle=None, compute_stream=None):
        return _unflatten(tensor, spec, _sync_grad_hook_scaling_half, device_handle, compute_stream)


def _sync_grad_hook_scaling_loaded(grad, *, device_handle=None, compute_stream=None):
    """torch's sync_grad_hook, times 1.01: a stray factor left on the gradients of a model
    that loaded a checkpoint (a loss scale restored twice, a hook registered again)."""
    return _dpu.sync_grad_hook(grad, device_handle=device_handle, compute_stream=compute_stream) * 1.01


def _modules_on_the_stack(method: str):
    """The modules whose ``method`` is running below the caller, innermost first."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == method and isinstance(frame.f_locals.get("self"), nn.Module):
            yield frame.f_locals["self"]
        frame = frame.f_back


class LoadedGradScales(TorchReference):
    """Once a model has loaded a state dict, ``_unflatten_tensor``'s hook scales its TP
    parameters' gradients by 1.01. FSDP1 rebuilds its DTensors through the transform while
    it loads (its pre-load hook unshards), which is where the mutant marks the model; a
    model that never loads trains as torch's does, so only checkpoint_resumes' resumed
    step departs, 1% where DP alone resumes exactly or an ulp away
    (oracles.checkpoints.no_larger)."""

    caught_by = frozenset({"checkpoint_resumes"})
    departs_as = frozenset({"TheResumedModelAfterTheStepIsTheUninterruptedOnes"})

    @staticmethod
    def unflatten_tensor(tensor, spec, *, device_handle=None, compute_stream=None):
        for loading in _modules_on_the_stack("load_state_dict"):
            loading._tpdp_mutant_loaded = True
        loaded = any(getattr(m, "_tpdp_mutant_loaded", False) for m in _modules_on_the_stack("forward"))
        hook = _sync_grad_hook_scaling_loaded if loaded else _dpu.sync_grad_hook
        return _unflatten(tensor, spec, hook, device_handle, compute_stream)


# -- (b) a rank aborts ------------------------------------------------------------------


class UnflattenDropsShapeAndStride(TorchReference):
    """``_unflatten_tensor`` calls ``DTensor.from_local`` without ``shape=``/``stride=``
    (as torch's did before it passed the spec's): from_local infers the global shape as
    local * tp, so with an uneven shard every tp rank believes a different global shape.

    Harmless until a collective is sized from that shape: a Colwise layer gathering its
    output (``output_layouts=Replicate()``, the ``uneven`` model's ``proj``) pads each rank's
    shard to the chunk its own belief implies, the ranks enter gloo's allgather with
    different sizes, and gloo's enforce in its transport thread aborts the process.
    """

    caught_by = frozenset({"trains_like_one_device", "trains_like_plain_ddp", "flatten_roundtrip"})
    # RankDied when training the uneven model; flatten_roundtrip (which calls unflatten
    # directly) reports GlobalShape instead
    departs_as = frozenset({"RankDied", "GlobalShape"})

    @staticmethod
    def unflatten_tensor(tensor, spec, *, device_handle=None, compute_stream=None):
        result = DTensor.from_local(tensor, spec.mesh, spec.placements, run_check=False)
        if tensor.requires_grad:
            tensor.register_hook(partial(_dpu.sync_grad_hook, device_handle=device_handle,
                                         compute_stream=compute_stream))
        return result


# -- (c) more regressions ---------------------------------------------------------------


class ReconstructSkipsLast(TorchReference):
    """``_reconstruct_dtensor`` updates all but the last TP parameter it collected (an
    off-by-one, ``param_list[:-1]``): the last one stays a plain local tensor in the
    forward, beside DTensors: the MLP's Rowwise bias, so every rank raises ``aten.addmm.default
    got mixed torch.Tensor and DTensor`` in the forward of w2 (with dim=1 the one-element
    bias is implicitly replicated instead, and the run fails later)."""

    caught_by = frozenset({"trains_like_one_device", "trains_like_plain_ddp"})
    departs_as = frozenset({"RaisesRuntimeError"})

    @staticmethod
    def reconstruct_dtensor(module: nn.Module, _input=None):
        param_list = []
        for name, t in module.named_parameters():
            if hasattr(t, "_st_info"):
                dtensor = _ddp._unflatten_tensor(t, t._st_info)
                param_list.append((*_ddp._get_submodule_n_params(module, name), dtensor))
        _ddp._update_module_param(param_list[:-1])


class LocalizeForgetsIgnored(TorchReference):
    """``_localize_dtensor`` drops its ``ignored_params`` check: replicate(ignored_modules=...)
    and any caller passing ignored parameters get them localized anyway."""

    caught_by = frozenset({"ignored_params_untouched"})
    departs_as = frozenset({"IgnoredAndPlainParametersStayUntouched"})

    @staticmethod
    def localize_dtensor(module: nn.Module, *_, ignored_params=None):
        param_list = []
        for name, param in module.named_parameters():
            t, sharding_info = _ddp._flatten_tensor(param)
            if sharding_info is not None:
                t = nn.Parameter(t)
                t._st_info = sharding_info
                param_list.append((*_ddp._get_submodule_n_params(module, name), t))
        _ddp._update_module_param(param_list)


class UpdateSkipsDelattr(TorchReference):
    """``_update_module_param`` sets the new value without deleting the old attribute
    first: a DTensor (not a Parameter) cannot be assigned over a registered parameter, so
    the forward pre-hook raises ``TypeError: cannot assign 'torch.FloatTensor' as parameter
    'weight'`` on every rank. Only properties that install the implementation see it:
    registry_preserved calls the implementation's pre_dp_module_transform, whose hooks
    (torch's) find torch's own ``_update_module_param`` in ddp's unpatched globals."""

    caught_by = frozenset({"trains_like_one_device", "trains_like_plain_ddp"})
    departs_as = frozenset({"RaisesTypeError"})

    @staticmethod
    def update_module_param(param_list):
        for parent_module, module_path, t in param_list:
            if not hasattr(parent_module, module_path):
                raise AssertionError
            setattr(parent_module, module_path, t)


class UpdateSkipsSetattr(TorchReference):
    """``_update_module_param`` deletes the old attribute and never sets the new one (the
    ``setattr`` lost in an edit): every TP parameter leaves its module. The harness must
    report what is gone as a failed check, never raise on the module it finds (issue 42)."""

    caught_by = frozenset({"registry_preserved", "trains_like_one_device"})
    departs_as = frozenset({"ParametersStayRegisteredInOrder"})

    @staticmethod
    def update_module_param(param_list):
        for parent_module, module_path, t in param_list:
            if not hasattr(parent_module, module_path):
                raise AssertionError
            delattr(parent_module, module_path)


class LocalizeKeepsPlainTensors(TorchReference):
    """``_localize_dtensor`` puts the local shard back as a plain tensor, not wrapped in
    ``nn.Parameter`` (the wrap lost in an edit): the module then holds it as a plain
    attribute, so DP and the optimizer never see the TP parameters. A failed check, never
    an error of the harness's own (issue 42)."""

    caught_by = frozenset({"registry_preserved", "trains_like_one_device"})
    departs_as = frozenset({"ParametersStayRegisteredInOrder"})
    localize_dtensor = staticmethod(_edited(_ddp._localize_dtensor, "t = nn.Parameter(t)", "t = t"))


class LocalizeFlattensTheShard(TorchReference):
    """``_localize_dtensor`` registers each local shard flattened to one dim (as a refactor
    toward flat parameters would): DP trains parameters of another shape than the ones the
    module's forward and the TP spec expect, and ``_reconstruct_dtensor`` rebuilds DTensors
    whose local shard has the wrong shape. A failed check or the code under test raising,
    never an error of the harness's own (issue 42)."""

    caught_by = frozenset({"registry_preserved", "trains_like_one_device"})
    departs_as = frozenset({"RaisesRuntimeError"})
    localize_dtensor = staticmethod(_edited(_ddp._localize_dtensor, "t = nn.Parameter(t)",
                                            "t = nn.Parameter(t.flatten())"))


class FlattenReturnsTheFullTensor(TorchReference):
    """``_flatten_tensor`` returns the gathered global tensor in place of the local shard
    (``full_tensor()``, as a refactor that confused the two would): DP then buckets and
    reduces a tensor of the global shape, and the structural checks get a value of the
    wrong shape, which they must fail, not raise on (the suite's checks are total)."""

    caught_by = frozenset({"flatten_roundtrip"})
    departs_as = frozenset({"LocalHasTheShapeOfTSShard"})

    @staticmethod
    def flatten_tensor(tensor):
        if isinstance(tensor, DTensor):
            return tensor.full_tensor().detach().requires_grad_(), tensor._spec
        return tensor, None


class FlattenRefusesViews(TorchReference):
    """``_flatten_tensor`` raises on every DTensor, with a message about the local tensor's
    layout, not the mesh or group (a contiguity check that went in inverted): every DDP
    wrap with TP fails before the first step. A miswired case must count it a finding,
    not a refusal of the wiring (oracles.verdicts.refusal)."""

    caught_by = frozenset({"miswiring_refused_or_exact"})
    departs_as = frozenset({"RefusesAMiswiringBeforeTrainingOrTrainsExactly"})

    @staticmethod
    def flatten_tensor(tensor):
        if isinstance(tensor, DTensor):
            raise RuntimeError("flatten_tensor expects a contiguous local tensor, got a view")
        return tensor, None


TORCH_MUTANTS = [SyncGradHookScales, UnflattenDropsShapeAndStride, ReconstructSkipsLast,
                 LocalizeForgetsIgnored, UpdateSkipsDelattr, UpdateSkipsSetattr, LocalizeKeepsPlainTensors,
                 LocalizeFlattensTheShard]


# -- FSDP1's TP extension (DTensorExtensions) ------------------------------------------


def _get_box_off_by_one(tensor):
    """torch's ``_get_box`` with the chunk size floored one row short, ``(size - 1) // n``:
    the same as torch's on uneven shards (where 2.13 already overlaps), one row short on
    even ones, which then overlap too."""
    from torch.distributed.tensor.parallel import fsdp as _fsdp

    offsets, size = _TORCH_GET_BOX(tensor)
    if tensor.placements[0].is_shard():
        dim = tensor.placements[0].dim
        offsets = list(offsets)
        offsets[dim] = (tensor.size(dim) - 1) // tensor.device_mesh.size(0)
    return _fsdp.torch.Size(offsets), size


def _torch_get_box():
    from torch.distributed.tensor.parallel import fsdp as _fsdp

    return _fsdp._get_box


_TORCH_GET_BOX = _torch_get_box()


def _rebound(functions, globals_: dict) -> None:
    """Copies of torch's ``functions`` that look their helpers up in ``globals_``, put there:
    their code, file and line stay torch's, as a regression's would."""
    import types

    for fn in functions:
        globals_[fn.__name__] = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__,
                                                   fn.__closure__)


class ChunkBoxOffByOne:
    """torch's FSDP extension (``--impl torch_mutants.ChunkBoxOffByOne``; its transform is
    torch's) whose ``chunk_tensor`` builds shard metadata with ``_get_box`` one row short on
    even shards: overlapping metadata where torch 2.13 has it only on uneven shards. It runs
    torch's own code objects (their frames are torch's), so it carries the signature the
    shipped baseline records for the uneven fault; only a replay of the same case on torch
    tells them apart."""

    def __init__(self):
        import types

        import torch
        from torch.distributed.fsdp._common_utils import _FSDPDeviceHandle
        from torch.distributed.tensor.parallel import fsdp as _fsdp

        from tpdp_verify.impls.select import FSDP_FUNCTIONS

        ext = _fsdp.DTensorExtensions(_FSDPDeviceHandle.from_device(torch.device("cpu")))
        for f in FSDP_FUNCTIONS:
            setattr(self, f, getattr(ext, f))
        mutated = {**vars(_fsdp), "_get_box": _get_box_off_by_one}
        _rebound([_fsdp._get_box_for, _fsdp._create_sharded_tensor_md_from_dt, _fsdp._chunk_tensor], mutated)
        method = _fsdp.DTensorExtensions.chunk_tensor
        chunk = types.FunctionType(method.__code__, mutated, method.__name__, method.__defaults__, method.__closure__)
        self.chunk_tensor = types.MethodType(chunk, ext)


# -- (d) beyond the transform: what a TP+DP run calls around it -------------------------


@contextlib.contextmanager
def _replaced(*sites):
    """Each (owner, name, value) set for the run, torch's own put back after it: the
    pool's ranks are torch's again for the next run."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in sites]
    for owner, name, value in sites:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def _edit_installed(owner, name: str, old: str, new: str):
    """``owner.name`` with one edit (``_edited``), installed there for the run (``_replaced``)."""
    return _replaced((owner, name, _edited(getattr(owner, name), old, new)))


class ParallelCrossEntropyGradScales(TorchReference):
    """loss_parallel's ``nll_loss`` backward returns the gradient scaled by 1 + 1e-3: the
    sharded cross entropy's backward, as a regression in its handler would change it
    (torch/distributed/tensor/parallel/loss.py); the transform is torch's. Installed for
    the run only (``patched``)."""

    caught_by = frozenset({"losses_train_like_one_device"})
    departs_as = frozenset({"GradientBeyondItsBound"})

    @staticmethod
    def patched():
        from torch.distributed.tensor.parallel import loss

        nll_backward = torch.ops.aten.nll_loss_backward.default
        handler = loss.customized_loss_ops[nll_backward]

        def scaled(op_call, args, kwargs):
            return handler(op_call, args, kwargs) * (1 + 1e-3)

        return _replaced((loss, "customized_loss_ops", {**loss.customized_loss_ops, nll_backward: scaled}))


class IgnoredTargetsCountedInTheMean(TorchReference):
    """loss_parallel's ``_nll_loss_forward`` counts every target in the mean's denominator,
    the ignored (padding) ones too: ``total_weight`` the number of targets where torch
    counts ``target != ignore_index`` (torch/distributed/tensor/parallel/loss.py). The
    backward divides by the same count, so the loss and every gradient shrink by the share
    of padding, on cases with ignored targets and a mean reduction only (issue 42)."""

    caught_by = frozenset({"losses_train_like_one_device"})
    departs_as = frozenset({"GradientBeyondItsBound"})

    @staticmethod
    def patched():
        from torch.distributed.tensor.parallel import loss

        forward = loss._nll_loss_forward

        def counting_all(x, target, weight, local_weight, reduction, ignore_index, *args):
            result, total_weight = forward(x, target, weight, local_weight, reduction, ignore_index, *args)
            if reduction != loss.Reduction.MEAN.value or weight is not None:
                return result, total_weight
            every = torch.full_like(total_weight, target.numel())
            return result * total_weight / every, every

        return _replaced((loss, "_nll_loss_forward", counting_all))


class ClassWeightsLeftOutOfTheBackward(TorchReference):
    """loss_parallel's fused backward (``_nll_loss_and_log_softmax_backward``) leaves the
    class weights out of the gradient while the forward weighs the loss by them (the
    ``weight`` branch lost in an edit): the gradients of a weighted cross entropy depart;
    on cases with class weights and no ignored targets too, where torch 2.13 is exact."""

    caught_by = frozenset({"losses_train_like_one_device"})
    departs_as = frozenset({"GradientBeyondItsBound"})

    @staticmethod
    def patched():
        from torch.distributed.tensor.parallel import loss

        backward = loss._nll_loss_and_log_softmax_backward

        def unweighted(grad_output, x, target, weight, *args):
            return backward(grad_output, x, target, None, *args)

        return _replaced((loss, "_nll_loss_and_log_softmax_backward", unweighted))


class _FusedBackwardScaledUnder(TorchReference):
    """loss_parallel's fused backward (``_nll_loss_and_log_softmax_backward``) returns the
    gradient 0.1% too large under one reduction alone (``REDUCTION``), as an edit of that
    branch would: caught only where a case takes cross entropy under loss_parallel with that
    reduction through an entry point torch 2.13 trains exactly (the cover cases' edges,
    properties/losses.py; issue 52: none reached ``sum`` there, so a regression passed)."""

    REDUCTION = ""
    caught_by = frozenset({"losses_train_like_one_device"})
    departs_as = frozenset({"GradientBeyondItsBound"})

    @classmethod
    def patched(cls):
        from torch.distributed.tensor.parallel import loss

        backward, wanted = loss._nll_loss_and_log_softmax_backward, loss.Reduction[cls.REDUCTION.upper()].value

        def scaled(grad_output, x, target, weight, reduction, *args):
            grad = backward(grad_output, x, target, weight, reduction, *args)
            return grad * (1 + 1e-3) if reduction == wanted else grad

        return _replaced((loss, "_nll_loss_and_log_softmax_backward", scaled))


class FusedBackwardScaledUnderMean(_FusedBackwardScaledUnder):
    REDUCTION = "mean"


class FusedBackwardScaledUnderSum(_FusedBackwardScaledUnder):
    REDUCTION = "sum"


class FusedBackwardScaledUnderNone(_FusedBackwardScaledUnder):
    REDUCTION = "none"


class WeightsGatheredByTheFlatTarget(TorchReference):
    """A fix of fault 24 as a hurried commit would make it: loss_parallel's fused backward
    (``_nll_loss_and_log_softmax_backward``) gathers the class weights by ``safe_target``,
    the ignored targets masked, but that one was squeezed and flattened for the scatter
    above: the gather raises ``Index tensor must have the same number of dimensions``. In
    ``backward``, as 2.13's own fault 24 raises on cases with ignored targets too: there the
    error differs (CHANGED); with class weights alone, where 2.13 is exact, it is NEW."""

    caught_by = frozenset({"losses_train_like_one_device"})
    departs_as = frozenset({"RaisesRuntimeError"})

    @staticmethod
    def patched():
        from torch.distributed.tensor.parallel import loss

        return _edit_installed(loss, "_nll_loss_and_log_softmax_backward", "torch.gather(w, channel_dim, target)",
                               "torch.gather(w, channel_dim, safe_target)")


class NormLeftPerRank(TorchReference):
    """The total gradient norm over DTensor gradients computed from each rank's local
    shards, never reduced: what ``clip_grad_norm_`` and ``get_total_norm``
    (torch/nn/utils/clip_grad.py) would return if a regression dropped DTensor's dispatch
    of the norm. Each rank logs and clips by its own norm."""

    caught_by = frozenset({"entry_points_train_like_one_device"})
    departs_as = frozenset({"GradientNormBeyondItsBound"})

    @staticmethod
    def patched():
        from torch.nn.utils import clip_grad

        total_norm = clip_grad._get_total_norm

        def per_rank(tensors, *args, **kwargs):
            tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
            return total_norm([t.to_local() if isinstance(t, DTensor) else t for t in tensors], *args, **kwargs)

        return _replaced((clip_grad, "_get_total_norm", per_rank), (torch.nn.utils, "get_total_norm", per_rank))


class MergedGatherOnTheRootMesh(TorchReference):
    """DTensor's planner, merging the collectives of a dim sharded over several mesh dims into
    one over their flattened submesh (``_optimize_transform_infos``,
    torch/distributed/tensor/_redistribute.py), hands the merged step the root mesh, not
    the flattened one, as a one-word edit would: the merged gather runs over the root's first
    dim alone. Wrong where torch 2.13 is right, on dims that divide evenly (fault 34 is the
    uneven ones; issue 49)."""

    caught_by = frozenset({"nested_shards_read_back"})
    departs_as = frozenset({"FullTensorGivesT"})

    @staticmethod
    def patched():
        from torch.distributed.tensor import _redistribute

        return _edit_installed(_redistribute, "_optimize_transform_infos", "mesh=flattened_mesh,", "mesh=device_mesh,")


class ChunkSizesAndOffsetsSwapped(TorchReference):
    """DCP's chunk of a DTensor's local shard (``_create_chunk_from_dtensor``,
    torch/distributed/checkpoint/planner_helpers.py) takes its sizes for its offsets and its
    offsets for its sizes, as a swapped unpacking of ``compute_local_shape_and_global_offset``
    would: wrong where torch 2.13 checkpoints exactly, an unfused weight (fault 35 is the
    fused ones; issue 49)."""

    caught_by = frozenset({"fused_projections_read_back"})
    departs_as = frozenset({"RaisesCheckpointException"})

    @staticmethod
    def patched():
        from torch.distributed.checkpoint import planner_helpers

        return _edit_installed(planner_helpers, "_create_chunk_from_dtensor", "sizes, offsets = compute_local_shape",
                               "offsets, sizes = compute_local_shape")


@contextlib.contextmanager
def _caches_cleared(replacing):
    """``replacing`` (a context that swaps DTensor's sharding strategies), with DTensor's
    propagation caches (Python's and the C++ fast path's) emptied on the way in and out, so
    neither torch's strategies reach the mutant's run nor the mutant's a later run of
    torch's on the same ranks."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    try:
        with replacing:
            yield
    finally:
        _clear_sharding_prop_cache()


@contextlib.contextmanager
def _entry_replaced(mapping: dict, key, value):
    """``mapping[key]`` set to ``value`` for the run, torch's own put back after it."""
    saved = mapping[key]
    mapping[key] = value
    try:
        yield
    finally:
        mapping[key] = saved


@contextlib.contextmanager
def _entries_replaced(mapping: dict, keys, value):
    """``mapping[key]`` set to ``value`` for each of ``keys``, for the run."""
    with contextlib.ExitStack() as stack:
        for key in keys:
            stack.enter_context(_entry_replaced(mapping, key, value))
        yield


class MaxNormSummedOverShards(TorchReference):
    """DTensor reduces the shards' max norms by a sum, not a max: ``_get_norm_reduction_op``
    (torch/distributed/tensor/_ops/_math_ops.py) sends ``inf`` down the p-norm branch, as an
    edit that merged the two would. The 2-norm and the 1-norm stay right; the max norm of a
    gradient whose shards DTensor reduces across ranks (FSDP2's over dp) grows by the other
    shards' maxima, so clipping by it clips too hard (issue 42)."""

    caught_by = frozenset({"entry_points_train_like_one_device"})
    departs_as = frozenset({"GradientBeyondItsBound"})

    @staticmethod
    def patched():
        from torch.distributed.tensor._ops import _math_ops

        by_norm = _math_ops._get_norm_reduction_op

        def summed(norm_type):
            return _math_ops.NormReduction(1) if norm_type in (float("inf"), "inf") else by_norm(norm_type)

        return _caches_cleared(_replaced((_math_ops, "_get_norm_reduction_op", summed)))


class SoftmaxBackwardKeepsTheShard(TorchReference):
    """DTensor's strategy for softmax's backward (``softmax_backward_strategy``,
    torch/distributed/tensor/_ops/_math_ops.py) follows the gradient's sharding without
    replicating the softmax dim, as an edit that dropped ``replicate_reduction_dims`` would:
    each rank's ``_softmax_backward_data`` then sums ``grad * out`` over its own shard of
    the vocabulary only. Only a gradient arriving vocab-sharded meets it (the loss edges'
    expected cost: properties/losses.py EDGES), where torch 2.13 is exact (issue 42)."""

    caught_by = frozenset({"losses_train_like_one_device"})
    departs_as = frozenset({"GradientBeyondItsBound"})

    @staticmethod
    def patched():
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._ops import _math_ops

        kept = _edited(_math_ops.softmax_backward_strategy,
                       "placements=replicate_reduction_dims(src_spec.placements, [softmax_dim]),",
                       "placements=src_spec.placements,")
        strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
        return _caches_cleared(_entry_replaced(strategies, torch.ops.aten._softmax_backward_data.default, kept))


class BatchSumAveragedOverDP(TorchReference):
    """DTensor's strategy for ``nll_loss`` (``nll_loss_forward_strategy``,
    torch/distributed/tensor/_ops/_math_ops.py) reduces a sum over a target sharded on the
    batch as a mean over the ranks, as an edit of its reduction's branch would: a loss over
    the SPMD form's batch with ``reduction="sum"`` comes out 1/dp of the batch's. Only the
    batch losses without loss_parallel meet it (the SPMD edges through DTensor alone:
    properties/losses.py SPMD_EDGES), where torch 2.13 is exact (issue 49)."""

    caught_by = frozenset({"losses_train_like_one_device"})
    departs_as = frozenset({"LossBeyondItsBound"})

    @staticmethod
    def patched():
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._ops import _math_ops

        averaged = _edited(_math_ops.nll_loss_forward_strategy, 'reduction_op = "sum"', 'reduction_op = "avg"')
        strategies = DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs
        ops = (torch.ops.aten.nll_loss_forward.default, torch.ops.aten.nll_loss2d_forward.default)
        return _caches_cleared(_entries_replaced(strategies, ops, averaged))


class UnevenMeanTakenAsLinear(TorchReference):
    """DTensor's reduction strategy (``common_reduction_strategy``,
    torch/distributed/tensor/_ops/_math_ops.py) takes a mean over a dim sharded unevenly as
    linear, the guard that gathers it first dropped (as an edit for speed would): the mean of
    the ranks' means, each weighed alike. The loss averaged over an SPMD batch whose rows do
    not divide over the dp ranks comes out off; an even batch's is right. Only the uneven
    batches' cover cases meet it (properties/training.py uneven_batches), where torch 2.13 is
    exact over one dp dim (issue 49)."""

    caught_by = frozenset({"entry_points_train_like_one_device"})
    departs_as = frozenset({"LossBeyondItsBound"})

    @staticmethod
    def patched():
        from torch.distributed.tensor._ops import _math_ops

        linear = _edited(_math_ops.common_reduction_strategy,
                         "if not is_tensor_evenly_shardable_on_dim(local_shape, output_spec, dim):", "if False:")
        return _caches_cleared(_replaced((_math_ops, "common_reduction_strategy", linear)))


class AccumulatedGradReducedInParamDtype(TorchReference):
    """FSDP2 sums a gradient that TP holds as partial sums over tp (a SequenceParallel
    norm's) in the parameters' bfloat16 where the policy's ``reduce_dtype`` is float32, on
    the path torch 2.13 gets right: a gradient accumulated over microbatches, which
    ``to_accumulated_grad_if_needed`` casts to ``reduce_dtype`` before the reduction
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, ``_get_grad_inner_tensor``)."""

    caught_by = frozenset({"trains_like_plain_ddp"})
    departs_as = frozenset({"TpSumsGradientsAccumulatedOverMicrobatchesInTheReduceDtype"})

    @staticmethod
    def patched():
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

        inner = FSDPParam._get_grad_inner_tensor

        def lowered(fsdp_param, grad):
            low = fsdp_param.param_dtype
            if low is not None and isinstance(grad, DTensor) and grad.dtype != low:
                return inner(fsdp_param, grad.to(low)).to(grad.dtype)
            return inner(fsdp_param, grad)

        return _replaced((FSDPParam, "_get_grad_inner_tensor", lowered))


class DPReducedInParamDtype(TorchReference):
    """FSDP2 reduces gradients over dp in the gradients' own dtype, the policy's
    ``reduce_dtype`` dropped on the way into ``foreach_reduce``
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py): under a bfloat16
    ``param_dtype`` with a float32 ``reduce_dtype`` the reduce-scatter sums in bfloat16,
    whose error a trained value's bfloat16 bound hides (issue 42)."""

    caught_by = frozenset({"trains_like_plain_ddp"})
    departs_as = frozenset({"DpSumsGradientsInTheReduceDtype"})

    @staticmethod
    def patched():
        import inspect

        from torch.distributed.fsdp._fully_shard import _fsdp_param_group

        reduce = _fsdp_param_group.foreach_reduce
        takes = inspect.signature(reduce)

        def in_grad_dtype(*args, **kwargs):
            given = takes.bind(*args, **kwargs)
            given.arguments["reduce_dtype"] = None  # FSDP2 then reduces in the gradients' dtype
            return reduce(*given.args, **given.kwargs)

        return _replaced((_fsdp_param_group, "foreach_reduce", in_grad_dtype))


class HSDPSkipsReplicateAllReduce(TorchReference):
    """FSDP2's HSDP never all-reduces the reduce-scattered gradients over the replicate
    dimension (``foreach_reduce``'s ``dist.all_reduce`` over ``all_reduce_group``,
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), as a regression that
    dropped it would: each replica steps by its own rows' gradients."""

    caught_by = frozenset({"large_dp_trains_like_one_device"})
    departs_as = frozenset({"ReplicasAgreeOnGrads"})

    @staticmethod
    def patched():
        import torch.distributed as dist
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives

        class WithoutAllReduce:
            def __getattr__(self, name):
                return getattr(dist, name)

            @staticmethod
            def all_reduce(tensor, *args, **kwargs):
                return None

        return _replaced((_fsdp_collectives, "dist", WithoutAllReduce()))


class ShardReduceScatterScaled(TorchReference):
    """FSDP2's reduce-scatter over the shard dimension returns its result scaled by 1 + 1e-3
    (``DefaultReduceScatter.__call__``, torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py),
    as a regression in its divide factor would."""

    caught_by = frozenset({"large_dp_trains_like_one_device"})
    departs_as = frozenset({"GradientBeyondItsBound"})

    @staticmethod
    def patched():
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

        call = DefaultReduceScatter.__call__

        def scaled(self, output_tensor, *args, **kwargs):
            work = call(self, output_tensor, *args, **kwargs)
            if work is not None:
                work.wait()
            output_tensor.mul_(1 + 1e-3)

        return _replaced((DefaultReduceScatter, "__call__", scaled))
