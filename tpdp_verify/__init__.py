"""tpdp-verify: know that tensor parallelism composed with data parallelism trains exactly
like the unsharded model.

``verify_plan`` checks a user's model and TP plan; ``Report`` is what it returns;
``RankPool`` runs functions on real ranks. They load on first use, so importing the package
(as pytest does for the plugin) does not import torch.
"""

__all__ = ["RankPool", "Report", "UsageError", "verify_plan"]


def __getattr__(name: str):
    if name in ("verify_plan", "Report", "RankPool"):
        from tpdp_verify import torch_release

        torch_release.check()
    if name == "verify_plan":
        from tpdp_verify.plan import verify_plan

        return verify_plan
    if name == "Report":
        from tpdp_verify.report import Report

        return Report
    if name == "RankPool":
        from tpdp_verify.ranks.pool import RankPool

        return RankPool
    if name == "UsageError":
        from tpdp_verify.errors import UsageError

        return UsageError
    raise AttributeError(f"module 'tpdp_verify' has no attribute {name!r}")
