"""The conformance suite: every property tpdp-verify checks, in the order the gate runs them.

Each property is documented in docs/properties.md.
"""

from tpdp_verify.properties.checkpoint import (
    checkpoint_resumes,
    entry_points_checkpoint_resume,
    entry_points_state_dict_like_unsharded,
    state_dict_like_unsharded,
)
from tpdp_verify.properties.exclusions import EXCLUSIONS  # noqa: F401  (the suite's, tpdp_verify.runner.suite)
from tpdp_verify.properties.fsdp_extension import (
    all_gather_dtensor_full,
    chunk_dtensor_layout,
    chunk_tensor_metadata,
    fsdp_flatten_roundtrip,
)
from tpdp_verify.properties.large_dp import (
    large_dp_checkpoint_resumes,
    large_dp_state_dict_like_unsharded,
    large_dp_trains_like_one_device,
    large_dp_trains_like_plain_dp,
)
from tpdp_verify.properties.layouts import fused_projections_read_back, nested_shards_read_back
from tpdp_verify.properties.losses import losses_train_like_one_device
from tpdp_verify.properties.registry import (
    ignored_params_untouched,
    paths_resolve,
    registry_preserved,
    tp_keeps_requires_grad,
)
from tpdp_verify.properties.roundtrip import flatten_roundtrip
from tpdp_verify.properties.training import (
    entry_points_train_like_one_device,
    trains_like_one_device,
    trains_like_plain_ddp,
)
from tpdp_verify.properties.wiring import miswiring_refused_or_exact

# The transform's structure (and TP's own registry, DTensor's nested layouts), then training (miswired too; the DP
# that large models train with), then checkpoints, then FSDP1's extension.
ALL = (flatten_roundtrip, paths_resolve, registry_preserved, ignored_params_untouched, tp_keeps_requires_grad,
       nested_shards_read_back, fused_projections_read_back,
       trains_like_one_device, trains_like_plain_ddp, entry_points_train_like_one_device, losses_train_like_one_device,
       miswiring_refused_or_exact, large_dp_trains_like_one_device, large_dp_trains_like_plain_dp,
       state_dict_like_unsharded, entry_points_state_dict_like_unsharded,
       checkpoint_resumes, entry_points_checkpoint_resume, large_dp_state_dict_like_unsharded, large_dp_checkpoint_resumes,
       fsdp_flatten_roundtrip, chunk_dtensor_layout, all_gather_dtensor_full, chunk_tensor_metadata)
