"""Deliberately broken transforms: each must be caught by the properties.

Each class is an implementation under test (``--impl mutants.Name``) that breaks one
clause of the contract in tpdp_verify/transform.py and keeps the rest.
"""

import torch
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
