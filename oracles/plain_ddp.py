"""The plain-DDP oracle: the unsharded model under DDP over the case's dp groups, no TP.

Where TP+DP departs from one device, this run says whether DP alone departs the same
way (a DDP matter) or not (the TP->DP composition's).
"""

from __future__ import annotations

from tpdp_verify.cases import DDP_ENTRIES, DDPOptions, TrainCase
from tpdp_verify.execute import MESH_DIMS, rows
from tpdp_verify.training import Run, Trace, build, make_optimizer, train


def observe_plain_ddp(case: TrainCase) -> Trace:
    """On every rank: the unsharded model under plain DDP over the same dp groups.

    Ranks that share a dp coordinate see the same rows; each tp coordinate forms its own
    dp group, so every rank's trace is a complete plain-DDP run.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tpdp_verify.pool import device_mesh

    mesh = device_mesh(case.mesh_shape, MESH_DIMS)
    model = build(case)
    # FSDP needs no word about parameters that get no gradient; DDP does.
    options = (case.ddp if case.entry in DDP_ENTRIES else DDPOptions(find_unused_parameters=True)).kwargs()
    ddp = DDP(model, process_group=mesh["dp"].get_group(), **options)
    run = Run(ddp, model, rows(case, mesh.get_local_rank("dp")), no_sync=ddp.no_sync,
              handles=dict(model.named_parameters(remove_duplicate=False)))
    return train(case, run, make_optimizer(case, ddp.parameters()))
