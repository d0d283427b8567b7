"""``ExportOptions``: everything ``export`` is asked for, in one frozen object.

The CLI builds the same object from its flags (``tfgraph.cli.export.options_from_args``);
:func:`tfgraph.export` takes it or the same fields as keyword arguments. :meth:`resolved`
checks the choices against the target before any slow work and fills in the target's
defaults (its opset, its MatMulNBits accuracy level). Each stage is handed its *view*
(:meth:`ExportOptions.view`): the few fields it reads, never the whole object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, make_dataclass
from pathlib import Path

from tfgraph.errors import TfgraphError
from tfgraph.exporters.flavours import get_flavour
from tfgraph.exporters.ort.weights.quantize import DEFAULT_BLOCK_SIZE, check_weights
from tfgraph.exporters.targets import Target, get_target
from tfgraph.verify.tolerance import FP32, PARITY_SHAPES, Tolerance

MIN_OPSET = 18  # torch.onnx's dynamo exporter emits nothing older


@dataclass(frozen=True)
class ExportOptions:
    """What to export and how. ``target``: a :class:`tfgraph.exporters.target.Target` or a
    registered name (``ort``, ``onnx``, ``tensorrt@10.14``). ``precision`` (``fp16``, ``bf16``): the
    graph's floats outside the fp32 islands measured on the parity inputs, fp32 inputs and
    outputs with ``keep_io_types``. ``weights`` (``int8``, ``int4``): MatMul weights
    block-wise in ``MatMulNBits``; ``accuracy_level`` (4 quantizes activations per block, 0
    keeps them fp32; ``None``: the target's default)."""

    pipeline: str = "default"
    target: str | Target = "ort"
    opset: int | None = None  # None: the target's
    check_each_pass: bool = False
    external_data: bool | None = None  # None: automatic past 2 GB
    parity_shapes: tuple = PARITY_SHAPES
    tolerance: Tolerance = FP32
    trust_remote_code: bool = False
    attn_implementation: str | None = None
    dump_after: str | None = None
    kv_cache: bool = False
    precision: str = "fp32"
    keep_io_types: bool = False
    weights: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    symmetric: bool = True  # int4/int8 weights without zero points (the builder's default)
    quantize_lm_head: bool = True
    quantize_embeddings: bool = True
    accuracy_level: int | None = None
    # how int4/int8 weights are quantized: rtn, hqq, k_quant, gptq (exporters/ort/weights/
    # methods.py); gptq and weights="mixed" measure the weights' inputs on calibration_text
    # (its first calibration_tokens tokens); mixed puts int8_share of the weights in int8
    weight_method: str = "rtn"
    calibration_text: str | None = None
    calibration_tokens: int = 2048
    int8_share: float = 0.125
    # per-row past lengths in the cached graph (in-flight batching) where the target takes them;
    # False: machinery for the new rows only, one past length for the batch
    row_lengths: bool = True
    kv_dtype: str = "fp32"  # int8: the KV cache quantized (tfgraph/exporters/ort/int8_kv.py)
    kv_scales: str = "per-tensor"  # the int8 cache's scales: per-tensor or per-channel
    # paged: the cache in blocks of kv_block_size positions (PagedAttention, ort-cuda;
    # tfgraph/exporters/ort/paging.py)
    kv_layout: str = "shared"
    kv_block_size: int = 16
    # the runtime the artifact is laid out for: tfgraph, genai (onnxruntime-genai), optimum
    # (Optimum and transformers.js); tfgraph/exporters/flavours/
    flavour: str = "tfgraph"
    # dynamic axes kept at fixed sizes ("sequence", "batch=1"): a model whose own code fixes a
    # dimension (tfgraph/sources/static_axes.py); a string "a,b" or a tuple of entries
    static_axes: tuple[str, ...] | str = ()
    # a vision-language model's input image size (height, width) where its processor's shapes
    # follow the image's (Qwen2-VL's patch grid): "HxW" or a pair; None: the family's default
    image_size: tuple[int, int] | str | None = None
    # a text the finished artifact's quality is measured over (perplexity and KL against the
    # fp32 source, tfgraph/verify/quality.py), into report.json's "quality"; None: not measured
    quality_text: str | None = None

    @classmethod
    def of(cls, options: ExportOptions | None, fields: dict) -> ExportOptions:
        """``options`` with ``fields`` replaced (``target=None`` keeps the options' target)."""
        fields = dict(fields)
        if fields.get("target") is None:
            fields.pop("target", None)
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"export() got unexpected keyword arguments: {', '.join(unknown)}")
        return dataclasses.replace(options or cls(), **fields)

    def resolved(self, target: Target | None = None) -> ExportOptions:
        """These options checked against their target (``target``: it, already looked up),
        with its defaults filled in: the target as a :class:`Target`, the opset, the accuracy
        level."""
        from tfgraph.exporters.ort.int8_kv import check_kv_dtype
        from tfgraph.exporters.ort.paging import check_kv_layout
        from tfgraph.precision.islands import check_precision
        from tfgraph.sources.static_axes import parse_static_axes

        target = target or get_target(self.target)
        check_precision(self.precision, self.keep_io_types, target)
        level = check_weights(
            self.weights,
            self.block_size,
            target,
            self.accuracy_level,
            self.weight_method,
            self.calibration_text,
            self.int8_share,
        )
        check_kv_dtype(self.kv_dtype, self.kv_scales, self.kv_cache, target, self.precision)
        check_kv_layout(self, target)
        get_flavour(self.flavour).check(self, target)
        opset = target.opset if self.opset is None else self.opset
        check_opset(opset)
        if self.image_size not in (None, ""):  # a VLM's export sets it aside before its graphs
            raise TfgraphError(
                "--image-size sizes a vision-language model's images; this model takes none "
                "(drop the option)"
            )
        if self.quality_text is not None and not Path(self.quality_text).is_file():
            raise TfgraphError(
                f"--quality-text: no text file at '{self.quality_text}'; give a UTF-8 text file"
            )
        static = parse_static_axes(self.static_axes)  # names checked against the model's later
        return dataclasses.replace(
            self, target=target, accuracy_level=level, opset=opset, static_axes=static
        )

    def view(self, stage: str):
        """The fields stage ``stage`` reads (:data:`VIEWS`), as a small frozen object."""
        cls = _VIEW_CLASSES[stage]
        return cls(**{f: getattr(self, f) for f in VIEWS[stage]})

    def pipeline_options(self, max_positions: int | None):
        """What the pass pipeline is asked for (the source's position limit sizes tables)."""
        from tfgraph.passes import PipelineOptions

        return PipelineOptions(
            kv_cache=self.kv_cache,
            max_positions=max_positions,
            row_lengths=self.row_lengths,
            kv_layout=get_flavour(self.flavour).kv_layout,
        )


# stage → the fields it reads: each stage function is handed ``options.view(stage)``
VIEWS = {
    "loading": ("trust_remote_code", "attn_implementation"),
    "tracing": ("trust_remote_code", "attn_implementation", "opset", "static_axes", "kv_cache"),
    "checking": ("check_each_pass", "dump_after"),
    "quantizing": (
        "target",
        "precision",
        "keep_io_types",
        "weights",
        "block_size",
        "symmetric",
        "quantize_lm_head",
        "quantize_embeddings",
        "accuracy_level",
        "kv_scales",
        "weight_method",
        "calibration_text",
        "calibration_tokens",
        "int8_share",
    ),
    "saving": ("target", "pipeline", "precision", "kv_cache", "external_data", "flavour"),
    "flavouring": ("target", "precision", "weights", "kv_cache", "kv_dtype", "flavour"),
    "verifying": ("kv_cache", "precision", "tolerance", "weights"),
}
_VIEW_CLASSES = {
    stage: make_dataclass(f"{stage.capitalize()}Options", fields, frozen=True)
    for stage, fields in VIEWS.items()
}


def check_opset(opset: int) -> None:
    """Refuse an opset the exporter cannot write (instead of a silent conversion)."""
    import onnx

    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise TfgraphError(
            f"--opset {opset} is not supported: choose {MIN_OPSET} to {newest} "
            f"(torch.onnx's exporter starts at {MIN_OPSET}; this onnx knows up to {newest})"
        )
