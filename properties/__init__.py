"""The conformance suite: every property tpdp-verify checks, in the order the gate runs them.

Each property is documented in docs/properties.md.
"""

from tpdp_verify.properties.registry import (
    ignored_params_untouched,
    paths_resolve,
    registry_preserved,
)
from tpdp_verify.properties.roundtrip import flatten_roundtrip
from tpdp_verify.properties.training import (
    entry_points_train_like_one_device,
    trains_like_one_device,
    trains_like_plain_ddp,
)

ALL = (flatten_roundtrip, paths_resolve, registry_preserved, ignored_params_untouched,
       trains_like_one_device, trains_like_plain_ddp, entry_points_train_like_one_device)
