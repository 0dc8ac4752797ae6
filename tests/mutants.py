"""Deliberately broken transforms: each must be caught by the properties.

Each class is an implementation under test (``--impl mutants.Name``) that breaks one
clause of the contract in tpdp_verify/impls/transform.py and keeps the rest.
"""

import torch
from torch.distributed.tensor import DTensor, Replicate

from tpdp_verify.impls import transform


class Reference(transform.Transform):
    """The reference; each mutant overrides one method and inherits the rest, so a broken
    tensor function is felt by the module transform as it would be in torch."""

    # the kinds of divergence trains_like_one_device may report (tests/test_training.py)
    training_caught_by = frozenset()
    shown_shrunk = False


class DropsShapeAndStride(Reference):
    """Lets from_local infer the global shape: wrong whenever a dim shards unevenly."""

    caught_by = 'global shape'

    def unflatten_tensor(self, local, info):
        return DTensor.from_local(local, info.mesh, info.placements, run_check=False)


class ForgetsPlacements(Reference):
    caught_by = 'placements'

    def unflatten_tensor(self, local, info):
        info = info._replace(placements=tuple(Replicate() for _ in info.placements))
        return super().unflatten_tensor(local, info)


class CopiesShard(Reference):
    """DP would then update a copy and never the model's shard."""

    caught_by = 'local shares storage'

    def flatten_tensor(self, t):
        local, info = super().flatten_tensor(t)
        if info is None:
            return local, info
        return local.detach().clone().requires_grad_(local.requires_grad), info


class CutsGradient(Reference):
    caught_by = 'requires_grad'
    # backward finds nothing to differentiate: torch raises (on every rank where nothing
    # else reaches the loss), and replicas that got no gradient disagree with those that did
    training_caught_by = frozenset({"raised RuntimeError at torch/_tensor.py:backward",
                                    "replicas agree on grads", "gradient present where the oracle has one"})

    def unflatten_tensor(self, local, info):
        return super().unflatten_tensor(local.detach(), info)


class AlwaysRequiresGrad(Reference):
    caught_by = 'local requires_grad'

    def flatten_tensor(self, t):
        local, info = super().flatten_tensor(t)
        return (local.requires_grad_(), info) if info is not None else (local, info)


class WrapsPlainTensors(Reference):
    caught_by = 'flatten of a plain tensor is the identity'

    def flatten_tensor(self, t):
        return super().flatten_tensor(t) if isinstance(t, DTensor) else (t.clone(), None)


class CastsToFloat32(Reference):
    caught_by = 'dtype'

    def unflatten_tensor(self, local, info):
        return super().unflatten_tensor(local.to(torch.float32), info)


MUTANTS = [DropsShapeAndStride, ForgetsPlacements, CopiesShard, CutsGradient,
           AlwaysRequiresGrad, WrapsPlainTensors, CastsToFloat32]


# -- the module transform ------------------------------------------------------------


class ResolvesToRoot(Reference):
    caught_by = "path resolves to the owning module and attribute"
    # a first draw meets the transform's own LookupError on the wrong owner: the check
    # itself speaks only on the shrunk case, where the owner has an attribute of that name
    shown_shrunk = True

    def get_submodule_n_params(self, module, path):
        return module, path.rpartition(".")[2]


class ReplacesByDelattr(Reference):
    """delattr then setattr, as torch does: the slot moves to the end of _parameters."""

    caught_by = "replacement keeps the registration order"

    def update_module_param(self, entries):
        for owner, attr, tensor in entries:
            delattr(owner, attr)
            setattr(owner, attr, tensor)


class ThawsFrozen(Reference):
    """nn.Parameter's default requires_grad, as torch's transform has it."""

    caught_by = "requires_grad"
    training_caught_by = frozenset({"the same parameters are trainable"})

    def local_parameter(self, param):
        local = super().local_parameter(param)
        return None if local is None else local.requires_grad_()


class BreaksTies(Reference):
    """Replaces a tied parameter at its first site only."""

    caught_by = "tied parameters"

    def parameter_sites(self, module):
        return {k: (p, sites[:1]) for k, (p, sites) in super().parameter_sites(module).items()}


class ForgetsIgnored(Reference):
    caught_by = "ignored and plain parameters stay untouched"

    def localize_dtensor(self, module, *_, ignored_params=None):
        super().localize_dtensor(module)


class NeverLocalizesAgain(Reference):
    """No forward hook: DTensors rebuilt for the forward stay in the registry."""

    caught_by = "the registry holds the parameters DP captured"

    def localize_dtensor(self, module, *_, ignored_params=None):
        if not _:  # localize when wrapping; as the forward hook (module, input, output), do nothing
            super().localize_dtensor(module, ignored_params=ignored_params)


class HookPerForward(Reference):
    caught_by = "hooks per step"

    def reconstruct_dtensor(self, module, _input=None):
        super().reconstruct_dtensor(module)
        module.register_forward_hook(lambda *_: None)


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
    def unflatten_tensor(self, local, info):
        return Reference.unflatten_tensor(self, _ScaleGradient.apply(local, factor), info)

    return unflatten_tensor


class ScalesGradientUp(Reference):
    """Every sharded parameter's gradient times 1 + 1e-3: the tolerance model must see it."""

    caught_by = "gradient beyond its bound"
    training_caught_by = frozenset({"gradient beyond its bound", "output beyond its bound"})
    unflatten_tensor = _scales_gradient(1 + 1e-3)


class ScalesGradientDown(Reference):
    caught_by = "gradient beyond its bound"
    training_caught_by = frozenset({"gradient beyond its bound", "output beyond its bound"})
    unflatten_tensor = _scales_gradient(1 - 1e-3)


class ShiftsShards(Reference):
    """Rebuilds each DTensor from the next tp rank's layout: right shapes, wrong values."""

    caught_by = "output beyond its bound"
    training_caught_by = frozenset({"output beyond its bound"})

    def unflatten_tensor(self, local, info):
        return super().unflatten_tensor(local.roll(1, 0) if local.dim() else local, info)


class StaleAfterFirstStep(Reference):
    """Reconstructs from the shard it saw first: the optimizer's later updates never reach
    the forward."""

    caught_by = "output beyond its bound"
    training_caught_by = frozenset({"output beyond its bound"})

    def unflatten_tensor(self, local, info):
        frozen = getattr(local, "_tpdp_first", None)
        if frozen is None:
            frozen = local._tpdp_first = local.detach().clone()
        return super().unflatten_tensor(frozen + (local - local.detach()), info)


# Caught by the gradient-equality properties too: what they break shows up in training.
# Not CopiesShard: the module transform then trains the copy consistently, which training
# cannot tell apart (flatten_roundtrip catches it); not ForgetsPlacements: its forward
# hangs in mismatched collectives, an infrastructure failure with no verdict (the gate
# exits 3; flatten_roundtrip catches it as a divergence).
TRAINING_MUTANTS = [ScalesGradientUp, ScalesGradientDown, ShiftsShards, StaleAfterFirstStep,
                    CutsGradient, ThawsFrozen]
