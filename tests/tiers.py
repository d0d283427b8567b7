"""Which tests are in the ``slow`` tier (``python -m pytest -m slow``); the rest is the default
tier, the README's test command, which must stay under 20 minutes on a 2-core machine while
covering every capability end to end at least once.

Sweeps keep a few representative cases in the default tier — chosen so that each target, each
precision and weight format, the KV cache on a decoder and an encoder-decoder, generation,
Triton, re-check, the CLI and bad inputs stay covered there — and move the rest of their cases
to ``slow``. Both tiers run in full on the same install; neither skips anything.
"""

from __future__ import annotations

# test (file::function) → the parameter ids that stay in the default tier; every other case
# of that test is slow. An empty set: the whole test is slow.
SWEEPS: dict[str, tuple[set[str], str]] = {
    "test_quantized_cache_rows.py::test_every_accepted_combination": (
        {"fp16-int4-fp32"},
        "every precision x weight format x KV dtype on a 512-wide Llama with a cache (12 "
        "exports); fp16 with int4 weights stays (int4 and int8 alone are the module's other "
        "tests)",
    ),
    "test_quantized_cache_rows.py::test_the_readmes_int4_cached_command_exits_0": (
        set(),
        "the README's llama-120m int4 --kv-cache export as a user runs it (a 120M checkpoint, "
        "about 1.5 minutes)",
    ),
    "test_triton_faults.py::test_two_hundred_requests_with_bad_ones_mixed_in": (
        set(),
        "the in-flight server's fault load at full size (200 requests, bad ones mixed in); "
        "the default tier runs it with 48",
    ),
    "test_streamed_checkpoints.py::test_low_precision_checkpoint_exports_with_parity": (
        {
            "llama-bf16-ort",
            "mistral-fp16-ort",
            "qwen2-bf16-ort",
            "bert-fp16-onnx",
            "bart-bf16-ort",
            "mixtral-fp16-ort",
        },
        "bf16 and fp16 checkpoints of the 17 HF architectures the tests use, exported to all "
        "four targets (136 cases): three decoders on ort, an encoder on onnx, an "
        "encoder-decoder (BART) and Mixtral, which loads whole, on ort stay",
    ),
    "test_streamed_checkpoints.py::test_same_graph_as_loading_whole": (
        set(),
        "a streamed checkpoint's graph and bytes against the whole-loaded model's",
    ),
    "test_streamed_checkpoints.py::test_estimate_is_close_to_the_artifact": (
        set(),
        "the budget's size estimate against written artifacts (fp32, int4)",
    ),
    "test_nbits.py::test_same_nodes_and_bytes_as_matmul_nbits_quantizer": (
        {"llama-tiny-4-False-4"},
        "per-MatMul quantization against MatMulNBitsQuantizer on three presets",
    ),
    "test_zoo_pipelines.py::test_preset_all_targets": (
        {"llama-tiny", "t5-tiny", "bert-tiny"},
        "every preset x every pipeline and target: a decoder, an encoder-decoder and an encoder "
        "stay in the default tier",
    ),
    "test_generation_parity.py::test_cached_generation": (
        {"preset:llama-tiny", "preset:t5-tiny", "hf:gpt2", "masked:gpt2"},
        "every preset and HF architecture generating through the cache on ort",
    ),
    "test_generation_parity.py::test_static_cache_generation_on_the_onnx_target": (
        {"gpt2-tiny", "t5-tiny"},
        "every preset generating through the static cache on onnx",
    ),
    "test_generation_parity.py::test_static_cache_generation_on_the_tensorrt_target": (
        {"llama-tiny"},
        "the static cache on tensorrt's graph for four presets",
    ),
    "test_bf16.py::test_zoo_bf16_on_the_reference_runner": (
        {"llama-tiny"},
        "the zoo's bf16 sweep (numpy's reference evaluator, op by op)",
    ),
    "test_bf16.py::test_zoo_bf16_cached": ({"gpt-tiny"}, "bf16 with the cache, three presets"),
    "test_precision.py::test_zoo_fp16_cached": (
        {"llama-tiny", "bart-tiny"},
        "the zoo's fp16 sweep with the cache",
    ),
    "test_precision.py::test_hugging_face_fp16": ({"gpt2"}, "HF architectures in fp16"),
    "test_hf_pipelines.py::test_hf_model_all_targets": (
        {"gpt2-eager", "t5-eager", "qwen3_next-eager", "mamba-eager"},
        "HF architectures x attention implementations x targets",
    ),
    "test_fuzz.py::test_campaign_passes": (set(), "a fuzz campaign over the whole model space"),
    "test_fuzz.py::test_cli_reports_a_broken_lowering": (
        set(),
        "a fuzz campaign against a broken lowering until it is found and shrunk",
    ),
    "test_attention_fusion.py::test_preset_layers": (
        {"llama-tiny", "t5-tiny"},
        "per-layer attention fusion of eleven presets",
    ),
    "test_bias_windows.py::test_windows_longer_than_the_short_lengths_are_found": (
        {"40"},
        "the long-window check at three window sizes",
    ),
    "test_bmm_attention.py::test_bmm_layout_models_are_complete": (
        {"xglm-causal-lm-XGLMForCausalLM"},
        "bmm-layout HF architectures as coverage rows",
    ),
    "test_hf_batched_generation.py::test_padded_batch_equals_hf_generate": (
        {"llama"},
        "padded batches against HF generate for five architectures",
    ),
    "test_attention_sinks.py::test_sinks_fuse_into_gqa_head_sink_and_cache": (
        {"concat"},
        "three forms of attention sinks fused and cached",
    ),
    "test_bench_smoke.py": (
        set(),
        "the quick bench end to end (python -m tfgraph bench --quick, about 2 minutes); the "
        "bench sections' own tests stay in the default tier",
    ),
    "test_coverage.py::test_subset_is_complete": (
        set(),
        "the HF architecture matrix over ten architectures (each built, exported twice and "
        "generating)",
    ),
}


def is_slow(nodeid: str) -> bool:
    """Whether the test ``nodeid`` (``tests/file.py::function[param]``) is in the slow tier."""
    name, _, param = nodeid.partition("[")
    name = name.removeprefix("tests/")
    if name.split("::")[0] in SWEEPS:  # a whole file
        return True
    if name not in SWEEPS:
        return False
    kept, _reason = SWEEPS[name]
    return param.rstrip("]") not in kept if param else not kept
