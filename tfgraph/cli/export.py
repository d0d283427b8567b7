"""``tfgraph export MODEL -o DIR``: trace, optimize, export to ONNX and check parity."""

from __future__ import annotations

import sys
from pathlib import Path

from tfgraph.cli.output import (
    print_compatibility,
    print_fusions,
    print_parity,
    print_precision,
    print_quality,
    print_weights,
    progress,
    table,
)
from tfgraph.exporters.flavours import FLAVOURS

EXPORT_STEPS = ("load", "trace", "passes", "save", "parity")

# optimum-cli's spellings (`optimum-cli export onnx -m MODEL --task … --dtype … --device … OUT`)
DEVICES = {"cpu": "ort", "cuda": "ort-cuda"}  # --device → the ONNX Runtime target
# --task: what `optimum-cli export onnx` takes; "-with-past" asks for the KV cache. The graph's
# inputs and outputs come from the model itself (its config's architecture), whatever the task
TASKS = (
    "auto",
    *(
        f"{task}{past}"
        for task in ("text-generation", "text2text-generation", "automatic-speech-recognition",
                     "image-to-text")
        for past in ("", "-with-past")
    ),
    "feature-extraction", "fill-mask", "text-classification", "token-classification",
    "question-answering", "multiple-choice", "sentence-similarity", "image-classification",
    "audio-classification", "object-detection", "semantic-segmentation",
)  # fmt: skip


def add_parser(sub):
    """The ``export`` subcommand; its flags group by group, in the order ``--help`` lists them."""
    p = sub.add_parser("export", help="trace, optimize, export to ONNX and check parity")
    _add_source_and_pipeline(p)
    _add_checks_and_output(p)
    _add_precision_and_weights(p)
    _add_loading(p)
    _add_kv_cache(p)
    p.set_defaults(func=run, resolve=resolve_aliases, usage_error=p.error)


def _add_source_and_pipeline(p):
    """The model, the artifact directory, the pipeline, the target and its opset."""
    from tfgraph.exporters.targets import target_names
    from tfgraph.passes import PIPELINES

    p.add_argument(
        "model",
        nargs="?",
        help="preset name, package.module:function, or a HF model directory (or -m MODEL)",
    )
    p.add_argument(
        "output_dir", nargs="?", metavar="OUTPUT", type=Path, help="artifact directory (or -o)"
    )
    p.add_argument("-m", "--model", dest="model_option", metavar="MODEL", help="the model")
    p.add_argument("-o", "--output", type=Path, help="artifact directory")
    p.add_argument("--pipeline", default="default", choices=list(PIPELINES))
    p.add_argument(
        "--target",
        metavar="TARGET",
        help=f"target backend: {', '.join(target_names())}, or tensorrt@X.Y "
        "(python -m tfgraph targets lists them; default: ort)",
    )
    p.add_argument(
        "--device",
        choices=list(DEVICES),
        help="as optimum-cli: cpu → --target ort, cuda → --target ort-cuda",
    )
    p.add_argument(
        "--task",
        choices=TASKS,
        metavar="TASK",
        help="as optimum-cli: text-generation-with-past (any *-with-past) → --kv-cache; other "
        "tasks export the model as its config.json names it",
    )
    p.add_argument(
        "--opset", type=int, help="default-domain opset (default: the target's; 20 for ort)"
    )


def _add_checks_and_output(p):
    """Checks along the way (checker, dumps, parity tolerances) and how weights are stored."""
    p.add_argument(
        "--check-each-pass",
        action="store_true",
        help="run the ONNX checker and shape inference after every pass",
    )
    p.add_argument(
        "--external-data",
        action="store_true",
        help="store weights in model.onnx.data (automatic past 2 GB)",
    )
    p.add_argument(
        "--dump-after",
        metavar="PASS",
        help="also save the graph after pass PASS as after_PASS.onnx in the artifact",
    )
    p.add_argument("--atol", type=float, default=1e-4, help="parity: absolute tolerance")
    p.add_argument("--rtol", type=float, default=1e-3, help="parity: relative tolerance")
    p.add_argument(
        "--quality-text",
        metavar="FILE",
        help="after parity, measure the artifact's perplexity, KL divergence and top-1 "
        "agreement against the fp32 source over this text (report.json's quality; as "
        "tfgraph quality DIR --text FILE)",
    )


def _add_precision_and_weights(p):
    """The graph's float type and weight-only quantization."""
    p.add_argument(
        "--precision",
        "--dtype",  # optimum-cli's spelling
        dest="precision",
        choices=["fp32", "fp16", "bf16"],
        default="fp32",
        help="the graph's float type; fp32 islands are kept where measured values need them "
        "(targets list what they take: `tfgraph targets`)",
    )
    _add_weight_quantization(p)
    p.add_argument(
        "--keep-io-types",
        action="store_true",
        help="with --precision fp16/bf16: fp32 inputs and outputs (cast at the graph's edge)",
    )


def _add_weight_quantization(p):
    """--weights and its knobs: block size, accuracy level, zero points, what stays fp32."""
    p.add_argument(
        "--weights",
        choices=["int8", "int4", "mixed"],
        help="weight-only quantization of MatMul weights (MatMulNBits, ort targets); parity "
        "then runs against eager with the same dequantized weights. mixed: int4, and int8 for "
        "the weights most sensitive on --calibration-text (--int8-share of them)",
    )
    p.add_argument(
        "--method",
        dest="weight_method",
        choices=["rtn", "hqq", "k_quant", "gptq"],
        default="rtn",
        help="--weights: how (ONNX Runtime's routines). rtn: round to nearest (default, "
        "seconds); hqq: optimized float zero points, no data (a few times rtn's time; int4, "
        "asymmetric by construction, runs at accuracy level 0); k_quant: llama.cpp's scale "
        "search, no data (~20x rtn's time; asymmetric by construction); gptq: error feedback "
        "through each input's Hessian, needs --calibration-text (a calibration pass, then "
        "minutes on a large model; int4)",
    )
    p.add_argument(
        "--calibration-text",
        metavar="FILE",
        help="--method gptq, --weights mixed: text the weights' inputs are measured on "
        "(tokenized with the model's tokenizer)",
    )
    p.add_argument(
        "--calibration-tokens",
        type=int,
        default=2048,
        help="--calibration-text: tokens used, in windows of 256 (default 2048)",
    )
    p.add_argument(
        "--int8-share",
        type=float,
        default=0.125,
        help="--weights mixed: the share of the MatMul weights put in int8, the most "
        "sensitive first (default 0.125)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=32,
        help="--weights: rows of K per scale (a power of two >= 16; default 32)",
    )
    p.add_argument(
        "--accuracy-level",
        type=int,
        choices=[0, 4],
        help="--weights: MatMulNBits accuracy level. 4 (default on the CPU): activations "
        "quantized to int8 per block, the fast kernel, and the eager reference quantizes them "
        "alike; 0: fp32 activations",
    )
    zero_points = p.add_mutually_exclusive_group()
    zero_points.add_argument(
        "--symmetric",
        dest="symmetric",
        action="store_true",
        default=True,
        help="--weights: no zero points (the default, as onnxruntime-genai's builder; the "
        "faster kernel)",
    )
    zero_points.add_argument(
        "--asymmetric",
        dest="symmetric",
        action="store_false",
        help="--weights: a zero point per block (a little closer to the weights, more bytes)",
    )
    p.add_argument(
        "--no-quantize-lm-head",
        action="store_true",
        help="--weights: keep the LM head in fp32",
    )
    p.add_argument(
        "--no-quantize-embeddings",
        action="store_true",
        help="--weights int4: keep the embedding tables in fp32 (default: int4 "
        "GatherBlockQuantized; int8 always keeps them)",
    )


def _add_loading(p):
    """How a model is loaded and traced."""
    p.add_argument(
        "--attn-implementation",
        choices=["eager", "sdpa"],
        help="Hugging Face directories: attention implementation to load (default: the "
        "library's; falls back to eager if the default does not trace)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a model directory's own Python code to run",
    )
    p.add_argument(
        "--image-size",
        metavar="HxW",
        default=None,
        help="a vision-language model's image size where its processor's shapes follow the "
        "image's (Qwen2-VL's patch grid): the vision graph is made for it and images are "
        "resized to it (default: the vision config's image_size, else 448x448)",
    )
    p.add_argument(
        "--static-axes",
        metavar="AXIS[,AXIS]",
        default="",
        help="keep these dynamic axes (sequence, batch; AXIS=SIZE for a size) at the example "
        "inputs' sizes: for a model whose own code fixes a dimension (the trace error names "
        "it); the graph then takes those sizes only",
    )


def _add_kv_cache(p):
    """The KV cache: whether there is one, its rows, layout, blocks, dtype and scales."""
    p.add_argument(
        "--kv-cache",
        action="store_true",
        help="decoders: add past/present KV inputs and outputs (for `generate`); parity then "
        "checks prefill and decode steps",
    )
    p.add_argument(
        "--no-row-lengths",
        action="store_true",
        help="one past length for the whole batch (machinery computed once for the batch, not "
        "gathered per row); no in-flight batching",
    )
    p.add_argument(
        "--kv-layout",
        choices=("shared", "paged"),
        default="shared",
        help="paged: the cache in blocks found through a block table (PagedAttention; "
        "--target ort-cuda --precision fp16; CUDA only: the graph is checked here, not run)",
    )
    p.add_argument(
        "--flavour",
        choices=FLAVOURS,
        default="tfgraph",
        help="lay the artifact out for a runtime: tfgraph (default; its own runtime), genai "
        "(onnxruntime-genai's og.Model), optimum (Optimum's ORTModelForCausalLM and "
        "transformers.js); docs/ecosystem.md",
    )
    p.add_argument(
        "--kv-block-size",
        type=int,
        default=16,
        help="--kv-layout paged: positions per block (a power of two >= 16; default 16)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=("fp32", "int8"),
        default="fp32",
        help="the KV cache's dtype: int8 holds a quarter of fp32's bytes (ort target; scales "
        "measured on the parity inputs, parity by a rule derived from the quantization's own "
        "effect)",
    )
    p.add_argument(
        "--kv-scales",
        choices=("per-tensor", "per-channel"),
        default="per-tensor",
        help="the int8 cache's scales: one per layer's K and V (default), or one per kv head "
        "and channel (finer, but clamps values beyond the ranges measured on the parity "
        "inputs: measured worse, docs/kv-cache.md)",
    )


def options_from_args(args):
    """The ``ExportOptions`` the command line asks for (parity shapes: the default)."""
    from tfgraph.options import ExportOptions
    from tfgraph.verify.tolerance import Tolerance

    return ExportOptions(
        pipeline=args.pipeline,
        target=args.target,
        opset=args.opset,
        check_each_pass=args.check_each_pass,
        external_data=True if args.external_data else None,
        tolerance=Tolerance(args.atol, args.rtol),
        trust_remote_code=args.trust_remote_code,
        attn_implementation=args.attn_implementation,
        dump_after=args.dump_after,
        kv_cache=args.kv_cache,
        precision=args.precision,
        keep_io_types=args.keep_io_types,
        weights=args.weights,
        block_size=args.block_size,
        symmetric=args.symmetric,
        quantize_lm_head=not args.no_quantize_lm_head,
        quantize_embeddings=not args.no_quantize_embeddings,
        accuracy_level=args.accuracy_level,
        weight_method=args.weight_method,
        calibration_text=args.calibration_text,
        calibration_tokens=args.calibration_tokens,
        int8_share=args.int8_share,
        row_lengths=not args.no_row_lengths,
        kv_dtype=args.kv_dtype,
        kv_scales=args.kv_scales,
        kv_layout=args.kv_layout,
        kv_block_size=args.kv_block_size,
        flavour=args.flavour,
        static_axes=args.static_axes,
        image_size=args.image_size,
        quality_text=args.quality_text,
    )


def resolve_aliases(args) -> None:
    """optimum-cli's spellings as the flags they stand for: ``-m MODEL`` (the positional then
    being the output), a positional output directory, ``--device``, ``--task``; a conflict is
    a usage error (``args.usage_error``: the subcommand's usage). Run as the arguments are
    parsed (``main``)."""
    error = args.usage_error
    positional = [a for a in (args.model, args.output_dir) if a is not None]
    if args.model_option is not None:
        if len(positional) == 2:
            error(f"the model is given twice: -m {args.model_option} and {positional[0]}")
        args.model, outputs = args.model_option, [Path(p) for p in positional]
    else:
        if not positional:
            error("the following arguments are required: model (or -m MODEL)")
        args.model, outputs = str(positional[0]), positional[1:]
    if args.output is not None:
        outputs.append(args.output)
    if len({Path(o) for o in outputs}) != 1:
        error(
            "give the artifact directory once: -o DIR, or as the last positional argument"
            if not outputs
            else f"two artifact directories: {' and '.join(map(str, outputs))}"
        )
    args.output = Path(outputs[0])
    if args.device is not None:
        wanted = DEVICES[args.device]
        if args.target not in (None, wanted) and args.target in DEVICES.values():
            error(f"--device {args.device} and --target {args.target} disagree: drop one")
        args.target = args.target or wanted
    args.target = args.target or "ort"
    if args.task is not None and args.task.endswith("-with-past"):
        args.kv_cache = True


def run(args) -> int:
    from tfgraph.exporting import export

    steps = (
        len(EXPORT_STEPS)
        + (args.precision != "fp32")
        + 2 * (args.weights is not None)
        + (args.kv_dtype != "fp32")
        + (args.kv_layout == "paged")
        + (args.flavour != "tfgraph")
        + (args.quality_text is not None)
    )
    from tfgraph.progress import listening
    from tfgraph.sources.vision_language import is_vision_language

    if is_vision_language(args.model):  # its vision and decoder graphs, each through the stages
        steps *= 2
    lines = progress(steps)
    with listening(lines):
        result = export(args.model, args.output, options_from_args(args))
    report = result.report
    if args.verbose:
        rows = [
            [p["name"], f"{p['seconds'] * 1000:.1f} ms", str(p["modified"])]
            for p in report["passes"]
        ]
        print(table(rows, ["pass", "time", "modified"]))
        print()
    files = [*result.manifest["files"], "manifest.json", "report.json"]
    print(f"wrote {result.out_dir}/ ({', '.join(files)})")
    print_fusions(report["fusions"], verbose=args.verbose)
    print_precision(report.get("precision") or {}, verbose=args.verbose)
    print_weights(report.get("weights"), verbose=args.verbose)
    print_compatibility(report.get("compatibility") or [], report["target"], args.verbose)
    print_parity(report["parity"], cached=bool(report.get("kv_cache")))
    print_quality(report.get("quality"), line=True)
    paged = report.get("paged")
    if paged:
        print(
            f"KV cache paged: {paged['layers']} layer(s) -> PagedAttention, blocks of "
            f"{paged['block_size']}; {paged['session_check']}; its numbers are unverified until "
            "run on a GPU (parity ran before paging)"
        )
    if not result.passed:
        print(f"error: parity failed; see {result.out_dir / 'report.json'}", file=sys.stderr)
        return 1
    return 0
