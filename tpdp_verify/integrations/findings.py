"""What tpdp-verify found in the stacks users bring, each with whose code is at fault and a
reproduction that needs only torch and that library (repros/, ``python FILE``: exit 1 while
the fault is there). The conformance table (tpdp_verify.integrations.conformance) names a
row's departure by these: the architecture, and a word of the departure's report (the
module or parameter it names, or torch's own error).

torch's faults are in tpdp_verify.faults (docs/known-divergences.md); these are another
project's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPROS = Path(__file__).resolve().parent / "repros"


@dataclass(frozen=True)
class Finding:
    code: str  # "T1": T for transformers
    project: str  # whose code is at fault
    architectures: tuple[str, ...]  # the model_types it was seen in
    marks: tuple[str, ...]  # a departure's report holds one of these where it is this finding
    title: str
    source: str  # the code at fault, "module:qualname" or the plan
    fix: str  # what would fix it, one line
    repro: str  # the file in repros/

    @property
    def repro_path(self) -> Path:
        return REPROS / self.repro

    def explains(self, model_type: str, said: str) -> bool:
        return model_type in self.architectures and any(m in said for m in self.marks)


FINDINGS = (
    Finding("T1", "transformers", ("apertus",), ("mlp.act_fn.alpha_",),
            "Apertus under TP trains its xIELU activation's learned scalars on each rank's shard of the MLP alone",
            "transformers.models.apertus.configuration_apertus:ApertusConfig.base_model_tp_plan",
            'add "layers.*.mlp.act_fn": "replicated_with_grad_allreduce" to the plan, as q_norm and k_norm have '
            "(verified: the row passes with that override)",
            "t1_apertus_xielu_scalars_unreduced.py"),
    Finding("T2", "transformers", ("llama4_text",), ("is a view and is being modified inplace",),
            "Llama 4's MoE block cannot train under TP: it adds in place to its TP'd shared expert's output",
            "transformers.models.llama4.modeling_llama4:Llama4TextMoe.forward",
            "out = out + ... in place of out.add_(...) (the output of a rowwise layer is a view autograd guards)",
            "t2_llama4_moe_adds_in_place_to_tp_output.py"),
    Finding("T3", "transformers", ("doge",), ("must match the size of tensor b",),
            "Doge's attention cannot run under its own TP plan: its dynamic mask covers every key-value head",
            "transformers.models.doge.configuration_doge:DogeConfig.base_model_tp_plan (dt_proj: rowwise)",
            "keep dt_proj's output and A to the rank's kv heads (a rowwise dt_proj sliced to the local heads)",
            "t3_doge_mask_over_every_head.py"),
)


def explained(model_type: str, said: str) -> Finding | None:
    """The finding a row's departure is, where one is."""
    return next((f for f in FINDINGS if f.explains(model_type, said)), None)
