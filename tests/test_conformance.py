"""A few rows of the transformers conformance table (tpdp_verify.integrations.conformance,
docs/transformers-conformance.md), run as the command runs them: a dense, a tied, an MoE
(with EP), one whose expert plan takes every rule of its TP plan (EP alone shards it) and an
MLA architecture, each on its tiny config, through transformers' own stack.
Needs the hf extra (`make test` installs it)."""

import json

import pytest
import torch

pytest.importorskip("transformers", reason="the hf extra: pip install -c constraints.txt -e .[hf]")

from helpers import script_run  # noqa: E402
from tpdp_verify.integrations import conformance  # noqa: E402
from tpdp_verify.integrations.findings import FINDINGS  # noqa: E402

ROWS = {"llama": "dense", "gemma3_text": "tied", "mixtral": "MoE", "minicpm3": "MLA (mla_kv_a_proj)",
        "dots3_note_vision_encoder": "EP alone: its TP plan names its experts only, which EP takes"}


@pytest.mark.timeout(600)
def test_a_dense_a_tied_an_moe_and_an_mla_architecture_pass_under_each_layout(tmp_path):
    out = tmp_path / "rows.json"
    table = tmp_path / "table.md"
    assert conformance.main([*[a for k in ROWS for a in ("-k", f"={k}")], "--layouts", "tp,tp_fsdp2,ep",
                             "--json", str(out), "--markdown", str(table)]) == 0
    rows = json.loads(out.read_text())
    assert set(ROWS) == set(rows)  # each exactly: -k =llama is not llama4
    for model_type in ROWS:
        layouts = rows[model_type]["layouts"]
        assert layouts["tp"]["result"] == "PASS" and layouts["tp_fsdp2"]["result"] == "PASS", (model_type, layouts)
    for moe in ("mixtral", "dots3_note_vision_encoder"):
        assert rows[moe]["layouts"]["ep"]["result"] == "PASS" and rows[moe]["experts"], rows[moe]
    assert rows["llama"]["layouts"]["ep"] == {"result": "n/a", "detail": "no expert plan"}
    assert "mla_kv_a_proj" in rows["minicpm3"]["styles"]
    assert rows["mixtral"]["layouts"]["tp"]["substituted"]  # grouped_mm's eager twin in the exact run
    assert "| llama | LlamaForCausalLM | PASS | PASS | n/a: no expert plan |" in table.read_text()


def test_a_tiny_config_keeps_one_layer_of_each_kind_and_what_tp_splits_divisible():
    config = conformance.tiny_config("gemma3_text")
    assert config.num_attention_heads % 2 == 0 and config.num_key_value_heads % 2 == 0 and config.vocab_size == 64
    mla = conformance.tiny_config("minicpm3")
    assert mla.num_key_value_heads == mla.num_attention_heads  # MLA's heads are key-value heads too
    hybrid = conformance.tiny_config("jamba")  # its layer kinds follow a period: enough layers for each
    assert {"linear_attention", "full_attention"} <= set(hybrid.layer_types[:hybrid.num_hidden_layers])


def test_a_composites_part_runs_as_its_own_class_on_the_config_its_composite_builds():
    """A part transformers maps no class to: the class its modeling module builds on it, and
    the config as its composite fills it (T5Gemma 2's decoder alone lacks a dropout rate)."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniThinkerTextModel

    assert conformance.model_class("qwen2_5_omni_text") is Qwen2_5OmniThinkerTextModel
    assert conformance.tiny_config("t5gemma2_decoder").dropout_rate == 0.0
    assert conformance.tiny_config("qwen3_omni_moe_talker_text").hidden_size == 32  # its holder's, not the top's
    from transformers.models.t5gemma.modeling_t5gemma import T5GemmaEncoder

    # no class's config_class: the one the module builds on it, T5GemmaEncoder(config.encoder)
    assert conformance.model_class("t5_gemma_module") is T5GemmaEncoder
    # a part that names input_ids and refuses them gets embeddings; a causal LM its own labels
    assert conformance.input_fn("qwen3_omni_moe_talker_code_predictor", False) == \
        conformance.Inputs("qwen3_omni_moe_talker_code_predictor", "inputs_embeds")
    assert conformance.input_fn("llama", True) is conformance.tokens_and_labels
    # a decoder alone gets its encoder's states; a text part its layers' conditioning (through **kwargs)
    assert conformance.input_fn("t5gemma2_decoder", False) == conformance.Inputs("t5gemma2_decoder",
                                                                                  "encoder_hidden_states")
    assert conformance.input_fn("voxtral_realtime_text", False) == conformance.Inputs("voxtral_realtime_text", "t_cond")
    # a Qwen-style vision encoder gets flattened patches with their grid; an encoder the count it requires, whole
    assert conformance.input_fn("ernie4_5_vl_moe_vision", False) == conformance.Inputs("ernie4_5_vl_moe_vision",
                                                                                        "grid_thw")
    counted = conformance.input_fn("deepseek_ocr2_encoder", False)(2, torch.Generator().manual_seed(0))
    assert counted["num_patches"] == conformance.SEQ // 2 and counted["inputs_embeds"].shape[0] == 2


def test_a_config_the_derivation_leaves_large_is_refused_on_the_meta_device(monkeypatch):
    monkeypatch.setattr(conformance, "MAX_PARAMETERS", 1000)
    with pytest.raises(ValueError, match=r"^the tiny config still makes \d+\.\dM parameters \(model\.embed_tokens"
                                         r"\.weight: \[64, 32\]\), beyond 0M: a size field of LlamaConfig"):
        conformance.Tiny("llama")()


@pytest.mark.timeout(600)
def test_a_row_that_departs_is_named_by_its_finding_and_else_fails_the_run(tmp_path, monkeypatch, capsys):
    """Apertus's xIELU scalars, which its plan leaves unreduced over tp: the row says T1;
    Inkling's normed embedding meets torch's fault 38; the run passes. With no finding to
    name Apertus's, its row fails the run (exit 1)."""
    from tpdp_verify.integrations import findings

    out = tmp_path / "rows.json"
    assert conformance.main(["-kapertus", "-kinkling_text", "--layouts", "tp", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    cells = {k: rows[k]["layouts"]["tp"] for k in ("apertus", "inkling_text")}
    assert [(c["result"], c["departs"], c["finding"]) for c in cells.values()] == [
        ("DIVERGES", True, "T1"), ("DIVERGES", True, "fault 38")], cells
    monkeypatch.setattr(findings, "FINDINGS", ())
    assert conformance.main(["-kapertus", "-kinkling_text", "--layouts", "tp"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == ("2 architectures, 2 cells; 1 depart with no finding to "
                                                        "explain them, or had no verdict: apertus tp")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("finding", FINDINGS, ids=[f.code for f in FINDINGS])
def test_each_findings_reproduction_shows_it_with_torch_and_transformers_alone(finding):
    """Each reproduction stands alone (python FILE) and exits 1 while the fault is there; it
    imports nothing of tpdp-verify."""
    text = finding.repro_path.read_text()
    assert "tpdp_verify" not in text and "from transformers" in text
    ran = script_run(finding.repro_path, [f.repro_path for f in FINDINGS], timeout=280)
    assert ran.returncode == 1 and ran.stdout.splitlines()[-1] == "fault present", ran.stdout + ran.stderr[-2000:]
    assert finding.project == "transformers" and finding.source.startswith("transformers.models.")


def test_a_findings_draft_is_filed_with_its_project():
    from tpdp_verify.integrations.findings import issue

    draft = issue(FINDINGS[0], runs=False)
    assert draft.splitlines()[:2] == [f"title: [TP] {FINDINGS[0].title}",
                                      "file at: https://github.com/huggingface/transformers/issues"]
