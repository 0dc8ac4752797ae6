"""Deliberately broken transforms: each must be caught by the properties.

Each class is an implementation under test (``--impl mutants.Name``) that breaks one
clause of the contract in tpdp_verify/transform.py and keeps the rest.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from tpdp_verify import transform
from tpdp_verify.impl import FUNCTIONS


class Reference:
    """The reference, function for function; each mutant overrides one."""

    locals().update({f: staticmethod(getattr(transform, f)) for f in FUNCTIONS})


class DropsShapeAndStride(Reference):
    """Lets from_local infer the global shape: wrong whenever a dim shards unevenly."""

    caught_by = 'global shape'

    @staticmethod
    def unflatten_tensor(local, info):
        return DTensor.from_local(local, info.mesh, info.placements, run_check=False)


class ForgetsPlacements(Reference):
    caught_by = 'placements'

    @staticmethod
    def unflatten_tensor(local, info):
        info = info._replace(placements=tuple(Replicate() for _ in info.placements))
        return transform.unflatten_tensor(local, info)


class CopiesShard(Reference):
    """DP would then update a copy and never the model's shard."""

    caught_by = 'local shares storage'

    @staticmethod
    def flatten_tensor(t):
        local, info = transform.flatten_tensor(t)
        if info is None:
            return local, info
        return local.detach().clone().requires_grad_(local.requires_grad), info


class CutsGradient(Reference):
    caught_by = 'requires_grad'

    @staticmethod
    def unflatten_tensor(local, info):
        return transform.unflatten_tensor(local.detach(), info)


class AlwaysRequiresGrad(Reference):
    caught_by = 'local requires_grad'

    @staticmethod
    def flatten_tensor(t):
        local, info = transform.flatten_tensor(t)
        return (local.requires_grad_(), info) if info is not None else (local, info)


class WrapsPlainTensors(Reference):
    caught_by = 'flatten of a plain tensor is the identity'

    @staticmethod
    def flatten_tensor(t):
        return transform.flatten_tensor(t) if isinstance(t, DTensor) else (t.clone(), None)


class CastsToFloat32(Reference):
    caught_by = 'dtype'

    @staticmethod
    def unflatten_tensor(local, info):
        return transform.unflatten_tensor(local.to(torch.float32), info)


MUTANTS = [DropsShapeAndStride, ForgetsPlacements, CopiesShard, CutsGradient,
           AlwaysRequiresGrad, WrapsPlainTensors, CastsToFloat32]


# -- the module transform ------------------------------------------------------------


def _localize(module, ignored_params=None, *, first_site_only=False, trainable=False):
    """The reference's localize with one clause switchable off."""
    ignored = {id(p) for p in ignored_params or ()}
    for param, sites in transform._parameter_sites(module).values():
        if id(param) in ignored:
            continue
        local = getattr(param, "_tpdp_local", None)
        if local is None:
            shard, info = transform.flatten_tensor(param)
            if info is None:
                continue
            local = nn.Parameter(shard, requires_grad=trainable or param.requires_grad)
            local._st_info = info
        sites = sites[:1] if first_site_only else sites
        transform.update_module_param([(owner, attr, local) for owner, attr in sites])


def _transform_with(localize):
    def pre_dp_module_transform(module):
        localize(module)
        module.register_forward_pre_hook(transform.reconstruct_dtensor)
        module.register_forward_hook(localize)
        module.register_state_dict_post_hook(transform._state_dict_of_dtensors)
        return module

    return staticmethod(pre_dp_module_transform)


class ResolvesToRoot(Reference):
    caught_by = "path resolves to the owning module and attribute"

    @staticmethod
    def get_submodule_n_params(module, path):
        return module, path.rpartition(".")[2]


class ReplacesByDelattr(Reference):
    """delattr then setattr, as torch does: the slot moves to the end of _parameters."""

    caught_by = "replacement keeps the registration order"

    @staticmethod
    def update_module_param(entries):
        for owner, attr, tensor in entries:
            delattr(owner, attr)
            setattr(owner, attr, tensor)


class ThawsFrozen(Reference):
    caught_by = "requires_grad"
    pre_dp_module_transform = _transform_with(
        lambda module, *_: _localize(module, trainable=True))


class BreaksTies(Reference):
    caught_by = "tied parameters"
    pre_dp_module_transform = _transform_with(
        lambda module, *_: _localize(module, first_site_only=True))


class ForgetsIgnored(Reference):
    caught_by = "ignored and plain parameters stay untouched"

    @staticmethod
    def localize_dtensor(module, *_, ignored_params=None):
        _localize(module)


class NeverLocalizesAgain(Reference):
    """No forward hook: DTensors rebuilt for the forward stay in the registry."""

    caught_by = "the registry holds the parameters DP captured"

    @staticmethod
    def pre_dp_module_transform(module):
        transform.localize_dtensor(module)
        module.register_forward_pre_hook(transform.reconstruct_dtensor)
        module.register_state_dict_post_hook(transform._state_dict_of_dtensors)
        return module


class HookPerForward(Reference):
    caught_by = "hooks per step"

    @staticmethod
    def reconstruct_dtensor(module, _input=None):
        transform.reconstruct_dtensor(module)
        module.register_forward_hook(lambda *_: None)

    @staticmethod
    def pre_dp_module_transform(module):
        transform.localize_dtensor(module)
        module.register_forward_pre_hook(HookPerForward.reconstruct_dtensor)
        module.register_forward_hook(transform.localize_dtensor)
        module.register_state_dict_post_hook(transform._state_dict_of_dtensors)
        return module


MODULE_MUTANTS = [ResolvesToRoot, ReplacesByDelattr, ThawsFrozen, BreaksTies, ForgetsIgnored,
                  NeverLocalizesAgain, HookPerForward]


# -- training: what the gradient-equality properties must catch ------------------------


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, factor):
        ctx.factor = factor
        return t.view_as(t)  # a view: the DTensor still shares the local shard's storage

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def _scales_gradient(factor: float):
    @staticmethod
    def unflatten_tensor(local, info):
        return transform.unflatten_tensor(_ScaleGradient.apply(local, factor), info)

    return unflatten_tensor


class ScalesGradientUp(Reference):
    """Every sharded parameter's gradient times 1 + 1e-3: the tolerance model must see it."""

    caught_by = "gradient beyond its bound"
    unflatten_tensor = _scales_gradient(1 + 1e-3)


class ScalesGradientDown(Reference):
    caught_by = "gradient beyond its bound"
    unflatten_tensor = _scales_gradient(1 - 1e-3)


class ShiftsShards(Reference):
    """Rebuilds each DTensor from the next tp rank's layout: right shapes, wrong values."""

    caught_by = "output beyond its bound"

    @staticmethod
    def unflatten_tensor(local, info):
        return transform.unflatten_tensor(local.roll(1, 0) if local.dim() else local, info)


class StaleAfterFirstStep(Reference):
    """Reconstructs from the shard it saw first: the optimizer's later updates never reach
    the forward."""

    caught_by = "output beyond its bound"

    @staticmethod
    def unflatten_tensor(local, info):
        frozen = getattr(local, "_tpdp_first", None)
        if frozen is None:
            frozen = local._tpdp_first = local.detach().clone()
        return transform.unflatten_tensor(frozen + (local - local.detach()), info)


# Caught by the gradient-equality properties too: what they break shows up in training.
TRAINING_MUTANTS = [ScalesGradientUp, ScalesGradientDown, ShiftsShards, StaleAfterFirstStep,
                    CutsGradient, CopiesShard, ForgetsPlacements, ThawsFrozen]
