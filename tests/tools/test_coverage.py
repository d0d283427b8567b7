"""The coverage matrix (``python -m tfgraph coverage``) on a fixed subset of architectures of
different kinds: each is built tiny from its config, exported as a user would, and must be
complete (every attention layer fused, parity, and for decoders a KV cache whose 32 greedy
tokens equal Hugging Face ``generate``). The full run is long and stays outside CI."""

import json

import pytest

from tfgraph.cli import main
from tfgraph.tools import coverage, coverage_generation, coverage_report

pytest.importorskip("transformers")

SUBSET = {
    "gpt2": "causal-lm",
    "llama": "causal-lm",
    "mistral": "causal-lm",
    "bloom": "causal-lm",
    "t5": "seq2seq-lm",
    "bart": "seq2seq-lm",
    "whisper": "speech-seq2seq",
    "bert": "encoder",
    "vit": "vision",
    "wav2vec2": "speech-encoder",
}


def test_architectures_are_read_from_transformers():
    rows = {m: (k, c) for m, k, c in coverage.architectures()}
    assert len(rows) > 200  # every auto mapping, not a registry of ours
    for model_type, kind in SUBSET.items():
        assert rows[model_type][0] == kind
    assert rows["whisper"][1] == "WhisperForConditionalGeneration"  # not WhisperForCausalLM


@pytest.mark.parametrize(
    "model_type, kind, cls",
    [
        ("gemma3", "causal-lm", "Gemma3ForConditionalGeneration"),
        ("qwen2_audio", "seq2seq-lm", "Qwen2AudioForConditionalGeneration"),
        ("t5gemma", "seq2seq-lm", "T5GemmaForConditionalGeneration"),
        ("mllama", "causal-lm", "MllamaForCausalLM"),
    ],
)
def test_composite_configs_are_tiny_in_every_sub_config(model_type, kind, cls):
    """A multimodal or encoder-decoder config keeps its parts in sub-configs, which the
    top-level overrides never reached: built from them, gemma3 had 2.7 B parameters and
    qwen2_audio 12.7 B, and the coverage worker was killed for memory. Each sub-config is
    now made tiny from its own class (and its special tokens fit the tiny vocabulary)."""
    import torch
    import transformers

    config = coverage.tiny_config(model_type, kind)
    with torch.device("meta"):
        model = getattr(transformers, cls)._from_config(config)
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    for name in config.sub_configs:
        sub = getattr(config, name)
        for key, value in coverage.TINY.items():
            if key in ("hidden_size", "num_hidden_layers") and hasattr(sub, key):
                assert getattr(sub, key) == value, (name, key)


# slow: the HF architecture matrix over ten architectures (each built, exported twice and
# generating)
@pytest.mark.slow
def test_subset_is_complete(tmp_path, capsys):
    assert (
        main(["coverage", "--out", str(tmp_path), "--only", ",".join(SUBSET), "--jobs", "2"]) == 0
    )
    data = json.loads((tmp_path / "coverage.json").read_text())
    rows = {r["model_type"]: r for r in data["rows"]}
    assert set(rows) == set(SUBSET)
    for row in rows.values():
        assert coverage_report.complete(row), row
        fused, total = row["attention"]
        assert fused == total > 0
    assert rows["whisper"]["main_input"] == "input_features"
    assert rows["vit"]["main_input"] == "pixel_values"
    assert all(rows[m]["tokens_equal"] for m, k in SUBSET.items() if k in coverage.DECODER_KINDS)
    assert data["summary"]["complete"] == data["summary"]["traced"] == len(SUBSET)
    text = (tmp_path / "COVERAGE.md").read_text()
    assert "complete (every attention layer fused" in text and "| gpt2 | causal-lm |" in text
    assert f"**{len(SUBSET)}** of {len(SUBSET)} traced (100%)" in text
    commit = data["meta"]["commit"]  # every row says which commit measured it
    assert commit and all(r["measured_at"] == commit for r in rows.values())
    assert f"Every row measured at commit {commit}." in text


def test_a_failure_is_a_row_and_a_rerun_resumes(tmp_path):
    row = coverage.run_one("gpt2", "causal-lm", "NoSuchModelClass")
    assert row["status"] == "not built" and "NoSuchModelClass" in row["reason"]
    assert not coverage_report.complete(row)
    path = tmp_path / "coverage.json"
    path.write_text(json.dumps({"rows": [row]}))
    data = coverage.run(tmp_path, only=["gpt2"])  # gpt2 has a row already: nothing reruns
    assert data["rows"] == [row]
    assert data["summary"]["by_status"] == {"not built": 1}
    text = coverage_report.markdown(data)
    assert "Rows measured at more than one commit: 1 at unknown." not in text
    later = {**row, "model_type": "llama", "measured_at": "abc1234"}
    text = coverage_report.markdown({**data, "rows": [row, later]})  # a resumed run at a new commit
    assert "Rows measured at more than one commit: 1 at abc1234, 1 at unknown." in text


def test_a_killed_row_leaves_no_files(tmp_path, monkeypatch):
    """A worker killed at the timeout (or by the OOM killer) never cleans up after itself; the
    parent owns its working directory and removes it. (Leaked rows once filled the disk.)"""
    import subprocess
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    def killed_mid_export(cmd, **kwargs):
        work = cmd[-1]
        seen.append(work)
        with open(f"{work}/model.onnx", "wb") as f:  # what the worker had written by then
            f.write(b"\0" * 1024)
        raise subprocess.TimeoutExpired(cmd, kwargs["timeout"])

    monkeypatch.setattr(coverage.subprocess, "run", killed_mid_export)
    row = coverage.run_one("gpt2", "causal-lm", "GPT2LMHeadModel", timeout=1)
    assert row["status"] == "timeout" and row["reason"] == "over 1 s"
    assert row["seconds"] >= 0  # a timed-out row says how long it ran, not "0 s"
    assert seen and seen[0].startswith(str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_eager_greedy_reference_equals_hf_generate():
    """The reference used where a model's own ``generate`` fails (Dory's) is greedy decoding
    by full recompute with the positions ``generate`` derives from the mask: on a model whose
    ``generate`` works, the two agree on a left-padded batch."""
    import torch
    import transformers

    from tfgraph.runtime.generate import left_pad

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=200, initializer_range=0.2
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids, mask = left_pad([list(p) for p in coverage_generation.PROMPTS], 0)
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    got = coverage_generation._eager_greedy_causal(model, ids, mask)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=coverage_generation.NEW_TOKENS,
            min_new_tokens=coverage_generation.NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    assert got == out[:, ids.shape[1] :].tolist()
    assert len({t for row in got for t in row}) > 2  # not one repeated token


def test_start_token_falls_back_to_the_decoder_config_then_bos():
    import transformers

    bart = transformers.BartConfig(decoder_start_token_id=7)
    assert coverage_generation._start_token(bart) == 7
    gpt2 = transformers.GPT2Config(bos_token_id=5)
    assert coverage_generation._start_token(gpt2) == 5


@pytest.mark.parametrize(
    "model_type, cls, kinds",
    [
        # default pattern cut to one layer of each kind
        ("lfm3", "Lfm3ForCausalLM", {"conv", "full_attention", "sliding_attention"}),
        ("qwen4_exp_text", "Qwen4ExpForCausalLM", {"linear_attention", "indexed_attention"}),
        # the same inside a composite config's text config
        ("qwen3_5", "Qwen3_5ForCausalLM", {"linear_attention", "full_attention"}),
        ("qwen3_5_moe", "Qwen3_5MoeForCausalLM", {"linear_attention", "full_attention"}),
        # a pattern derived from indices or periods, or missing from the default config
        ("jamba", "JambaForCausalLM", {"linear_attention", "full_attention"}),
        ("bamba", "BambaForCausalLM", {"linear_attention", "full_attention"}),
        ("granitemoehybrid", "GraniteMoeHybridForCausalLM", {"linear_attention", "full_attention"}),
        ("lfm2_moe", "Lfm2MoeForCausalLM", {"conv", "full_attention"}),
        ("zamba", "ZambaForCausalLM", {"linear_attention", "hybrid"}),
        ("zamba2", "Zamba2ForCausalLM", {"linear_attention", "hybrid"}),
    ],
)
def test_tiny_hybrids_keep_every_kind_of_layer_and_run(model_type, cls, kinds):
    """A tiny hybrid with its attention layers dropped exports as 'no attention' (lfm3 and
    Qwen4-Exp once did), or fails in Hugging Face's own cached forward (GraniteMoeHybrid's
    Mamba-only default: get_mask_sizes). Each kind stays, and the model runs eagerly."""
    import torch
    import transformers

    model_cls = getattr(transformers, cls)
    config = coverage.config_for(model_cls, coverage.tiny_config(model_type, "causal-lm"))
    assert isinstance(config, model_cls.config_class)
    types = config.layers_block_type if model_type in ("zamba", "zamba2") else config.layer_types
    assert set(types) == kinds and len(types) == config.num_hidden_layers
    torch.manual_seed(0)
    model = model_cls(config).eval()
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    with torch.no_grad():
        logits = model(torch.tensor([[3, 4, 5, 6, 7, 8]])).logits
    assert logits.shape == (1, 6, config.vocab_size)


@pytest.mark.parametrize(
    "model_type, cls",
    [
        ("convnext", "ConvNextForImageClassification"),
        ("convnextv2", "ConvNextV2ForImageClassification"),
        ("efficientnet", "EfficientNetForImageClassification"),
        ("levit", "LevitForImageClassification"),
        ("mobilevitv2", "MobileViTV2ForImageClassification"),
    ],
)
def test_tiny_vision_models_run_on_their_image_size(model_type, cls):
    """Per-stage lists cut with the stage count, widths that follow their multipliers: each
    tiny vision model runs on an image of its config's size (they once raised shape errors)."""
    import torch
    import transformers

    config = coverage.tiny_config(model_type, "vision")
    model = getattr(transformers, cls)(config).eval()
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    size = config.image_size
    with torch.no_grad():
        logits = model(torch.randn(2, config.num_channels, size, size)).logits
    assert logits.shape == (2, config.num_labels)


def test_the_acceptance_figure_leaves_out_unbuilt_rows_and_convnets():
    rows = [
        {"model_type": "a", "kind": "causal-lm", "status": "not built"},
        {"model_type": "b", "kind": "causal-lm", "status": "eager failed"},
        {"model_type": "c", "kind": "vision", "status": "no attention", "parity": True},
        {"model_type": "d", "kind": "encoder", "status": "no attention", "parity": True},
        {
            "model_type": "e",
            "kind": "encoder",
            "status": "exported",
            "parity": True,
            "attention": [2, 2],
        },
        {"model_type": "f", "kind": "causal-lm", "status": "trace failed"},
    ]
    summary = coverage_report.summarize(rows)
    assert [coverage_report.eligible(r) for r in rows] == [False, False, False, True, True, True]
    assert summary["eligible"] == 3 and summary["complete"] == 1
    text = coverage_report.markdown({"meta": {}, "summary": summary, "rows": rows})
    assert "of the 3 that build tiny and run eagerly" in text and "**33%**" in text
