"""transformers' own distributed stack, run as its users run it, as parallelize functions
for ``verify_plan(..., parallelize_fn=..., dp="own")``.

``from_pretrained(..., distributed_config=DistributedConfig(tp_size=.., fsdp_size=..))`` shards
a model with transformers' own code: ``DistributedMixin.maybe_distribute_model`` resolves the
model's TP, EP and FSDP plans (with the config's overrides), applies its own TP layers
(``transformers.distributed.tensor_parallel``), its EP, then FSDP2 over its ``fsdp_plan``
(HSDP with ``dp_replicate_size``). The functions here call that very method on the ranks,
on the harness's mesh, so every style transformers ships runs as transformers runs it; no
plan string is mapped onto torch's styles.

The one thing made here is the mesh holder: transformers builds its (pp, dp_replicate, fsdp,
tp) mesh over the whole world, rank-major as tpdp-verify's (dp, tp) or (dp_replicate,
dp_shard, tp) mesh is; the same layout is built here with those names, and checked to hold
the same tp groups, so each rank's batch is the one its dp coordinate gets.

Imported on the ranks only, where the user's model already imports transformers; the core
never imports this module.
"""

from __future__ import annotations

from torch import nn

DENSE = ("pp", "dp_replicate", "fsdp", "tp")  # transformers' names (distributed.utils.initialize_distributed_mesh)
EXPERT = ("pp", "dp_replicate", "efsdp", "ep")


def distribute(model: nn.Module, mesh, *, tp: bool = True, **config) -> nn.Module:
    """``model`` sharded by transformers' ``maybe_distribute_model`` on ``mesh`` (the
    harness's): tp_size from mesh["tp"] (1 where ``tp`` is False: transformers' own DP
    alone), fsdp_size and dp_replicate_size from its dp dims; ``config``: any other
    ``DistributedConfig`` field (tp_plan, fsdp_plan, ep_size, ep_plan overrides, ...)."""
    from transformers.distributed import DistributedConfig
    from transformers.distributed.utils import TransformersDeviceMesh

    sizes = dict(zip(mesh.mesh_dim_names, mesh.shape))
    replicas, shards, tp_ranks = sizes.get("dp_replicate", 1), sizes.get("dp_shard", sizes.get("dp", 1)), sizes["tp"]
    distributed = DistributedConfig(tp_size=tp_ranks if tp else 1, fsdp_size=shards, dp_replicate_size=replicas,
                                    **config)
    if distributed.tp_size == 1 and distributed.dp_size == 1 and distributed.ep_size == 1:
        return model  # transformers applies nothing (prepare_distribute_model returns no mesh)
    dense = _mesh((1, replicas, shards, tp_ranks), DENSE)
    if dense["tp"].mesh.tolist() != mesh["tp"].mesh.tolist():
        raise RuntimeError(f"transformers' mesh {dense} does not hold the harness's tp groups {mesh}")
    expert_ranks = distributed.ep_size if distributed.ep_size > 1 else 1
    expert = _mesh((1, replicas, shards * tp_ranks // expert_ranks, expert_ranks), EXPERT)
    tied = _untie(model)
    model = type(model).maybe_distribute_model(model, distributed, TransformersDeviceMesh(dense, expert))
    if tied:
        model.tie_weights(recompute_mapping=False)  # as from_pretrained's _finalize_model_loading does
    return model


def _untie(model: nn.Module) -> bool:
    """The model as from_pretrained has it when it distributes: instantiated untied
    (``init.no_tie_weights``), each tied parameter its own, holding the same values (the
    checkpoint's), tied again once loaded. Whether there was a tie to undo."""
    tied = False
    for target, source in dict(getattr(model, "all_tied_weights_keys", None) or {}).items():
        weight = model.get_parameter(source)
        owner, _, name = target.rpartition(".")
        holder = model.get_submodule(owner)
        if getattr(holder, name, None) is weight:
            setattr(holder, name, nn.Parameter(weight.detach().clone(), requires_grad=weight.requires_grad))
            tied = True
    return tied


def parallelize(model: nn.Module, mesh) -> nn.Module:
    """TP over mesh["tp"] with the model's own plan, then FSDP2 over the dp dims with its
    ``fsdp_plan`` (HSDP on a 3-D mesh), as ``DistributedConfig(tp_size=.., fsdp_size=..,
    dp_replicate_size=..)`` shards it."""
    return distribute(model, mesh)


def dp_alone(model: nn.Module, mesh) -> nn.Module:
    """transformers' own DP without TP, on the same dp groups (each tp coordinate a run of
    its own): the plain-DP comparison for ``parallelize`` (verify_plan's dp_alone_fn)."""
    return distribute(model, mesh, tp=False)


def expert_parallel(model: nn.Module, mesh) -> nn.Module:
    """``parallelize`` with the model's expert-parallel plan over as many ranks as tp
    (``ep_size = tp_size``): its experts split by expert, its dense layers by TP."""
    return distribute(model, mesh, ep_size=dict(zip(mesh.mesh_dim_names, mesh.shape))["tp"])


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    from tpdp_verify.ranks.rank import device_mesh

    return device_mesh(shape, names)  # made once per rank process, as the harness's own meshes are
