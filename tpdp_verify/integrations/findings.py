"""What tpdp-verify found in the stacks users bring, each with whose code is at fault and a
reproduction that needs only torch and that library (repros/, ``python FILE``: exit 1 while
the fault is there). The conformance table (tpdp_verify.integrations.conformance) names a
row's departure by these: the architecture, and a word of the departure's report (the
module or parameter it names, or torch's own error).

torch's faults are in tpdp_verify.faults (docs/known-divergences.md); these are another
project's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

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
    sharded: bool = True  # its reproduction shards the model (a TP fault); else it only builds it on the ranks

    @property
    def repro_path(self) -> Path:
        return REPROS / self.repro

    def explains(self, model_type: str, said: str) -> bool:
        return _explains(self, model_type, said)


class Seen(NamedTuple):
    """Where the conformance table meets a catalogued torch fault, and its departures' marks."""

    architectures: tuple[str, ...]
    marks: tuple[str, ...]

    def explains(self, model_type: str, said: str) -> bool:
        return _explains(self, model_type, said)


def _explains(known: Finding | Seen, model_type: str, said: str) -> bool:
    """Whether a departure of ``model_type`` whose report says ``said`` is ``known`` (the
    report's lines are folded: a mark is looked for in its words, whitespace aside)."""
    words = " ".join(said.split())
    return model_type in known.architectures and any(m in words for m in known.marks)


FINDINGS = (
    Finding("T1", "transformers", ("apertus",), ("mlp.act_fn.alpha_",),
            "Apertus under TP trains its xIELU activation's learned scalars on each rank's shard of the MLP alone",
            "transformers.models.apertus.configuration_apertus:ApertusConfig.base_model_tp_plan",
            'add "layers.*.mlp.act_fn": "replicated_with_grad_allreduce" to the plan, as q_norm and k_norm have '
            "(verified: the row passes with that override)",
            "t1_apertus_xielu_scalars_unreduced.py"),
    Finding("T2", "transformers", ("llama4_text", "llama4"), ("is a view and is being modified inplace",),
            "Llama 4's MoE block cannot train under TP: it adds in place to its TP'd shared expert's output",
            "transformers.models.llama4.modeling_llama4:Llama4TextMoe.forward",
            "out = out + ... in place of out.add_(...) (the output of a rowwise layer is a view autograd guards)",
            "t2_llama4_moe_adds_in_place_to_tp_output.py"),
    Finding("T3", "transformers", ("doge",), ("must match the size of tensor b",),
            "Doge's attention cannot run under its own TP plan: its dynamic mask covers every key-value head",
            "transformers.models.doge.configuration_doge:DogeConfig.base_model_tp_plan (dt_proj: rowwise)",
            "keep dt_proj's output and A to the rank's kv heads (a rowwise dt_proj sliced to the local heads)",
            "t3_doge_mask_over_every_head.py"),
    Finding("T4", "transformers", ("esmc",), ("expected input with shape",),
            "ESM C's attention cannot run under its own TP plan: its query and key norms normalize over every head",
            "transformers.models.esmc.configuration_esmc:EsmcConfig.base_model_tp_plan (q_proj, k_proj: colwise)",
            "q_proj and k_proj colwise_gather_output (the norms see every head), or norms that all-reduce their "
            "statistics over tp",
            "t4_esmc_norm_over_every_head.py"),
    Finding("T5", "transformers", ("qwen3_vl_moe_text", "qwen3_omni_moe_text", "muse_glimmer_assistant"),
            ("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
            "Qwen3-VL-MoE's text model (and Qwen3-Omni-MoE's thinker text model, MuseGlimmer's draft model) under TP "
            "trains its per-head query and key norms on each rank's heads alone",
            "transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe:Qwen3VLMoeTextConfig.base_model_tp_plan; "
            "transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe:Qwen3OmniMoeTextConfig."
            "base_model_tp_plan; "
            "transformers.models.muse_glimmer_assistant.configuration_muse_glimmer_assistant:"
            "MuseGlimmerAssistantConfig.base_model_tp_plan",
            'add "layers.*.self_attn.q_norm" and "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce" '
            "to the plan, as Qwen3's and Qwen3-MoE's have",
            "t5_qwen3_vl_moe_head_norms_unreduced.py"),
    Finding("T6", "transformers", ("neomme",), ("must match the size of tensor b",),
            "NeoMME's attention cannot run under its own TP plan: its exclusive self-attention holds a scale for "
            "every head",
            "transformers.models.neomme.configuration_neomme:NeoMMEConfig.base_model_tp_plan "
            "(exclusive_self_attention.alpha: not sharded)",
            'shard alpha by head as the heads are ("layers.*.self_attn.exclusive_self_attention.alpha": a dim-0 '
            "local shard over tp)",
            "t6_neomme_scale_for_every_head.py"),
    Finding("T7", "transformers", ("qwen3_omni_moe_talker_text",), ("builds different weights on rank",),
            "Qwen3-Omni-MoE's talker model, built from its config, leaves its experts' weights uninitialized",
            "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe:Qwen3OmniMoePreTrainedModel._init_weights",
            "initialize Qwen3OmniMoeTalkerTextExperts (gate_up_proj, down_proj) in _init_weights, as the "
            "thinker's sparse block's experts are",
            "t7_qwen3_omni_talker_experts_uninitialized.py", sharded=False),
    Finding("T8", "transformers", ("glm5_next_text",), ("is invalid for input of size",),
            "GLM-5-Next's text model cannot run under its own TP plan: its rowwise o_proj rule also takes the "
            "linear-attention layers, whose q, k and v it leaves whole",
            "transformers.models.glm5_next.configuration_glm5_next:Glm5NextTextConfig.base_model_tp_plan "
            '("layers.*.self_attn.o_proj": "rowwise" matches Glm5NextTextLinearAttention.o_proj too)',
            "keep the plan's attention rules off the linear-attention (KDA) blocks, e.g. a distinct name for their "
            "o_proj, or shard those blocks by head as well (verified: the row passes with the KDA blocks' o_proj "
            "left unsharded)",
            "t8_glm5_next_rowwise_o_proj_on_linear_attention.py"),
    Finding("T9", "transformers", ("inkling2_text",), ("mlp.experts.act_fn",),
            "Inkling2's text model under TP pairs the wrong halves of its experts' fused gate and up projection: "
            "its plan splits gate_up_proj as one weight, its experts chunk it in two on each rank",
            "transformers.models.inkling2.configuration_inkling2:Inkling2TextConfig.base_model_tp_plan "
            '("layers.*.mlp.experts.gate_up_proj": "colwise"; Inkling2Experts._apply_gate chunks it locally)',
            '"layers.*.mlp.experts.gate_up_proj": "packed_colwise", as the 50 other plans that name it have '
            "(verified: the row passes with that override); InklingTextConfig's plan has the same rule",
            "t9_inkling2_experts_gate_up_split_as_one.py"),
)


# torch's own faults (tpdp_verify.faults' catalog) that the conformance table meets: the fault's
# number -> where, and the marks of its departures there
TORCH_FAULTS = {
    38: Seen(("inkling_text", "muse_glimmer_text", "muse_glimmer", "muse_spark_text", "muse_spark"),
             ("placement_types.py:_reduce_value",)),
    41: Seen(("t5gemma2_text", "t5gemma2_decoder"), ("got mixed torch.Tensor and DTensor",)),
}


# The blocks of steps the reproductions of one kind share (each file stands alone, so each
# carries them; tpdp_verify.faults.spawn_block copies the first file's into the others):
# marker -> the findings whose files carry it
BLOCKS = {
    "# --- boilerplate: one step under transformers' own TP, and whether it raised": ("T2", "T3", "T4", "T6", "T8"),
    "# --- boilerplate: gradients under transformers' own TP against one device's": ("T1", "T5", "T9"),
}


def explained(model_type: str, said: str) -> str:
    """What a row's departure is, where it is known: a finding's code (T1), or a catalogued
    torch fault's label (fault 38); "" where nothing explains it."""
    found = next((f for f in FINDINGS if f.explains(model_type, said)), None)
    if found is not None:
        return found.code
    return next((f"fault {n}" for n, f in TORCH_FAULTS.items() if f.explains(model_type, said)), "")


def issue(f: Finding, runs: bool = True) -> str:
    """``tpdp-verify report T1``: the issue for ``f``, ready to file with its project: what is
    wrong (its reproduction's own account), the reproduction and what it printed here, where,
    the fix, the versions."""
    import ast
    from importlib import metadata

    from tpdp_verify.faults import issue as faults_issue
    from tpdp_verify.faults.record import PROJECTS

    text = f.repro_path.read_text()
    told = (ast.get_docstring(ast.parse(text)) or "").split("\n\n", 1)
    what = told[1].rsplit("\nRun:", 1)[0].strip() if len(told) > 1 else f.title
    ranks = f"shards the model as {f.project} does" if f.sharded else "builds the model on each"
    out = [f"title: {'[TP] ' if f.sharded else ''}{f.title}", f"file at: {PROJECTS[f.project]}", "",
           "### What is wrong", "", what, "", "### Reproduction", "",
           f"Needs torch and {f.project}; spawns its own 2 gloo ranks on the CPU and {ranks}. Save as "
           f"`{f.repro}` and run `python {f.repro}`: it prints what was expected and what the ranks did, and "
           "exits 1 while the fault is present, 0 once it is fixed.", "",
           "```python", text.rstrip(), "```", ""]
    if runs:
        shown = faults_issue.run(f, sys.executable)
        out += ["### Expected and actual", "", f"torch {shown.torch}, {f.project} {metadata.version(f.project)}: "
                f"{shown.verdict}", "", "```", faults_issue.unlocal(shown.output) or "(nothing printed)", "```", ""]
    out += ["### Where", "", f"`{f.source}`", "", "### Fix", "", f.fix[:1].upper() + f.fix[1:] + ".", "",
            "### Environment", "", f"{f.project} {metadata.version(f.project)}", "", "```",
            faults_issue.environment(), "```", "",
            f"Found by tpdp-verify (finding {f.code} of its {f.project} conformance table: "
            "`tpdp-verify docs transformers-conformance`)."]
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # python -m tpdp_verify.integrations.findings: copy the reproductions' blocks
    from tpdp_verify.faults import CATALOG, spawn_block

    done = spawn_block.sync([CATALOG[0].repro_path] + [f.repro_path for f in FINDINGS])
    for marker, codes in BLOCKS.items():
        done += spawn_block.sync([f.repro_path for f in FINDINGS if f.code in codes], marker)
    print(f"copied the first file's blocks into {len(done)} files" + "".join(f"\n  {p.name}" for p in done))

