"""Integrations with the stacks users train through (transformers, ...): optional, imported
only on the ranks of a run that names them; the core never imports them."""

# ``tpdp-verify plan --stack NAME``: the stack's own parallelize function, and its DP without
# TP for the plain-DP run (verify_plan's parallelize_fn and dp_alone_fn, with dp="own")
STACKS = {
    "transformers": ("tpdp_verify.integrations.transformers:parallelize",
                     "tpdp_verify.integrations.transformers:dp_alone"),
    "transformers-ep": ("tpdp_verify.integrations.transformers:expert_parallel",
                        "tpdp_verify.integrations.transformers:dp_alone"),
}
