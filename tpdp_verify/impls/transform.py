"""Reference implementation of the TP->DP transform, written from its contract.

The contract (torch keeps it private and undocumented; see docs/properties.md):

* ``flatten_tensor(t)`` hands data parallelism a plain tensor it can bucket and
  all-reduce: for a DTensor, its local shard as a leaf that shares the shard's storage
  and requires grad exactly when ``t`` does, plus the sharding info needed to rebuild
  ``t``; for anything else, ``t`` itself and ``None``.
* ``unflatten_tensor(local, info)`` rebuilds the DTensor ``t`` was: same mesh,
  placements, global shape, stride and dtype, with ``local`` as its shard, so that
  gradients of the DTensor land on ``local``.

The module transform built on them (``localize_dtensor``, ``reconstruct_dtensor``,
``pre_dp_module_transform``) must keep what a user relies on across the transform and any
number of forward passes: the parameter registry (names, order, global shapes), each
parameter's ``requires_grad``, tied parameters, ignored parameters, buffers, and a
constant number of hooks.

This module is torch's independent twin: it uses only public DTensor API (and a module's
``_parameters`` slots), so a divergence between the two points at one of them, never at
shared code. The functions are methods of ``Transform`` and the module transform calls the
tensor functions through ``self``, so an implementation that changes one of them (a
subclass: tests/mutants.py) changes it wherever a real implementation would feel it.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement


class ShardingInfo(NamedTuple):
    """What a local shard needs to become its DTensor again."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]


def flatten(t: torch.Tensor) -> tuple[torch.Tensor, ShardingInfo | None]:
    """A DTensor's shard as a leaf sharing its storage, and what rebuilds the DTensor from
    it; any other tensor as it is. Module level, shared by the reference transform and the
    reference FSDP extension, so that a mutant of one leaves the other intact."""
    if not isinstance(t, DTensor):
        return t, None
    with torch.no_grad():
        shard = t.to_local()
    local = shard.detach().requires_grad_(t.requires_grad)
    return local, ShardingInfo(t.device_mesh, tuple(t.placements), t.shape, t.stride())


def unflatten(local: torch.Tensor, info: ShardingInfo) -> DTensor:
    return DTensor.from_local(local, info.mesh, info.placements, run_check=False, shape=info.shape,
                              stride=info.stride)


class Transform:
    """The reference: one method for each function in tpdp_verify.impls.select.FUNCTIONS."""

    @staticmethod
    def patched():
        """What the reference installs for a run beyond the transform: FSDP2's sum of TP's
        partial gradients in the policy's reduce_dtype (tpdp_verify.impls.fsdp2_sums)."""
        from tpdp_verify.impls.fsdp2_sums import summed_in_reduce_dtype

        return summed_in_reduce_dtype()

    # -- the tensor transform --------------------------------------------------------

    def flatten_tensor(self, t: torch.Tensor) -> tuple[torch.Tensor, ShardingInfo | None]:
        return flatten(t)

    def unflatten_tensor(self, local: torch.Tensor, info: ShardingInfo) -> DTensor:
        return unflatten(local, info)

    # -- the module transform --------------------------------------------------------

    def get_submodule_n_params(self, module: nn.Module, path: str) -> tuple[nn.Module, str]:
        """The module that owns the parameter named ``path`` and its attribute name there."""
        prefix, _, attr = path.rpartition(".")
        try:
            owner = module.get_submodule(prefix)
        except AttributeError as exc:
            raise LookupError(f"parameter {path!r}: {exc}") from None
        if attr not in owner._parameters:
            raise LookupError(
                f"parameter {path!r}: {type(owner).__name__} at {prefix or '<root>'!r} has no parameter "
                f"{attr!r} (it has {', '.join(owner._parameters) or 'none'})"
            )
        return owner, attr

    def update_module_param(self, entries: list[tuple[nn.Module, str, torch.Tensor]]) -> None:
        """Put each tensor in its owner's parameter slot, keeping the registration order.

        The slot may hold a DTensor rebuilt for a forward pass: it stays in ``_parameters`` so
        that ``named_parameters()`` and ``state_dict()`` keep every name during the forward.
        """
        for owner, attr, tensor in entries:
            if attr not in owner._parameters:
                raise LookupError(
                    f"{type(owner).__name__} has no parameter {attr!r} to replace "
                    f"(it has {', '.join(owner._parameters) or 'none'})"
                )
            owner._parameters[attr] = tensor

    def parameter_sites(self, module: nn.Module) -> dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str]]]]:
        """Every parameter once, with every (owner, attribute) that holds it: tied weights and
        shared submodules give one parameter several names, and all must change together."""
        sites: dict[int, tuple[torch.Tensor, list]] = {}
        seen = set()
        for name, param in module.named_parameters(remove_duplicate=False):
            owner, attr = self.get_submodule_n_params(module, name)
            if (id(owner), attr) not in seen:
                seen.add((id(owner), attr))
                sites.setdefault(id(param), (param, []))[1].append((owner, attr))
        return sites

    def local_parameter(self, param: torch.Tensor) -> nn.Parameter | None:
        """The Parameter DP holds for ``param``: its local shard, with ``_st_info``; the very
        one it came from for a DTensor ``reconstruct_dtensor`` rebuilt; None for a plain one."""
        local = getattr(param, "_tpdp_local", None)
        if local is not None:
            return local
        shard, info = self.flatten_tensor(param)
        if info is None:
            return None
        local = nn.Parameter(shard, requires_grad=param.requires_grad)
        local._st_info = info
        return local

    def localize_dtensor(self, module: nn.Module, *_, ignored_params: set | None = None) -> None:
        """Swap each DTensor parameter for the Parameter of its local shard, at every site;
        and each DTensor buffer for its local shard, which DP then syncs as any buffer."""
        ignored = {id(p) for p in ignored_params or ()}
        for param, sites in self.parameter_sites(module).values():
            if id(param) in ignored:
                continue
            local = self.local_parameter(param)
            if local is not None:
                self.update_module_param([(owner, attr, local) for owner, attr in sites])
        ignored_buffers = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        for name, owner, attr, buffer in buffer_sites(module):
            local = None if name in ignored_buffers else self.local_buffer(buffer)
            if local is not None:
                owner._buffers[attr] = local

    def local_buffer(self, buffer: torch.Tensor) -> torch.Tensor | None:
        """The plain tensor DP holds for a DTensor buffer: its local shard sharing its storage,
        with ``_st_info``; the very one it came from for a rebuilt one; None for a plain one."""
        local = getattr(buffer, "_tpdp_local", None)
        if local is not None:
            return local
        shard, info = self.flatten_tensor(buffer)
        if info is not None:
            shard._st_info = info
        return shard if info is not None else None

    def reconstruct_dtensor(self, module: nn.Module, _input=None) -> None:
        """Rebuild the DTensor of every localized parameter and buffer for a forward pass."""
        for param, sites in self.parameter_sites(module).values():
            info = getattr(param, "_st_info", None)
            if info is None:
                continue
            dtensor = self.unflatten_tensor(param, info)
            dtensor._tpdp_local = param
            self.update_module_param([(owner, attr, dtensor) for owner, attr in sites])
        for _, owner, attr, buffer in buffer_sites(module):
            info = getattr(buffer, "_st_info", None)
            if info is not None:
                dtensor = self.unflatten_tensor(buffer, info)
                dtensor._tpdp_local = buffer
                owner._buffers[attr] = dtensor

    def state_dict_of_dtensors(self, module: nn.Module, state_dict: dict, prefix: str, _metadata) -> None:
        """A checkpoint taken between forwards holds DTensors, as before the transform."""
        for name, state in _states(module):
            info = getattr(state, "_st_info", None)
            if info is not None and prefix + name in state_dict:
                state_dict[prefix + name] = self.unflatten_tensor(state_dict[prefix + name], info)

    def load_local_shards(self, module: nn.Module, state_dict: dict, prefix: str, *_) -> None:
        """The other half of that contract: a checkpoint of DTensors loads into the local
        shards DDP registered, each entry cut to this rank's shard."""
        for name, state in _states(module):
            info = getattr(state, "_st_info", None)
            value = state_dict.get(prefix + name)
            if info is not None and isinstance(value, DTensor):
                state_dict[prefix + name] = value.redistribute(info.mesh, info.placements).to_local()

    def pre_dp_module_transform(self, module: nn.Module) -> nn.Module:
        """Localize now; rebuild DTensors before each forward and localize again after it;
        checkpoints hold DTensors, and load from them. What DDP was told to ignore is left
        as it is, now and after every forward: DDP names it on the module before it calls
        this (``_ddp_params_and_buffers_to_ignore``)."""
        ignored = {p for n, p in module.named_parameters()
                   if n in set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))}
        self.localize_dtensor(module, ignored_params=ignored)
        module.register_forward_pre_hook(self.reconstruct_dtensor)
        module.register_forward_hook(functools.partial(type(self).localize_dtensor, self, ignored_params=ignored))
        # partials, not bound methods: torch marks hooks with an attribute
        module.register_state_dict_post_hook(functools.partial(type(self).state_dict_of_dtensors, self))
        module.register_load_state_dict_pre_hook(functools.partial(type(self).load_local_shards, self))
        return module


def buffer_sites(module: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """Every buffer slot: its name, its owner, its attribute there, what it holds."""
    sites = []
    for name, buffer in module.named_buffers(remove_duplicate=False):
        prefix, _, attr = name.rpartition(".")
        sites.append((name, module.get_submodule(prefix), attr, buffer))
    return sites


def _states(module: nn.Module):
    """Parameters and buffers by name, duplicates included: what a state_dict holds."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


REFERENCE = Transform()
# The module-level names torch's call sites and tpdp_verify.impls.select look up.
flatten_tensor = REFERENCE.flatten_tensor
unflatten_tensor = REFERENCE.unflatten_tensor
get_submodule_n_params = REFERENCE.get_submodule_n_params
update_module_param = REFERENCE.update_module_param
localize_dtensor = REFERENCE.localize_dtensor
reconstruct_dtensor = REFERENCE.reconstruct_dtensor
pre_dp_module_transform = REFERENCE.pre_dp_module_transform
patched = REFERENCE.patched
