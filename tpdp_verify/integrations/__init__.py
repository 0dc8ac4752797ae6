"""Integrations with the stacks users train through (transformers, ...): optional, imported
only on the ranks of a run that names them; the core never imports them."""

from typing import NamedTuple


class Stack(NamedTuple):
    """``tpdp-verify plan --stack NAME``: the stack's own parallelize function, its DP without
    TP for the plain-DP run (verify_plan's parallelize_fn and dp_alone_fn, with dp="own"),
    and whether its DP sums gradients, its loss being each rank's share (loss_share)."""

    parallelize: str
    dp_alone: str
    loss_share: bool = False


STACKS = {
    "transformers": Stack("tpdp_verify.integrations.transformers:parallelize",
                          "tpdp_verify.integrations.transformers:dp_alone"),
    "transformers-ep": Stack("tpdp_verify.integrations.transformers:expert_parallel",
                             "tpdp_verify.integrations.transformers:dp_alone"),
    "torchtitan": Stack("tpdp_verify.integrations.torchtitan:parallelize_llama",
                        "tpdp_verify.integrations.torchtitan:dp_alone", loss_share=True),
    # its output a DTensor of the global batch: the loss is the step's whole, not a rank's share
    "torchtitan-full-dtensor": Stack("tpdp_verify.integrations.torchtitan:parallelize_llama_full_dtensor",
                                     "tpdp_verify.integrations.torchtitan:dp_alone_full_dtensor"),
}
