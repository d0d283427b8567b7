"""The precision and weights stages of ``export``, after the fp32 pipeline: the graph's floats
in fp16/bf16 outside the measured fp32 islands, MatMul weights in int4/int8 with the eager
reference that computes as the quantized kernels do, the KV cache in int8. Each is one step of
the export's step runner (:class:`tfgraph.passes.pipeline.run.Steps`): recorded, checked,
dumped and probed as every pass is. ``options`` is the ``quantizing`` view."""

from __future__ import annotations

from pathlib import Path

from tfgraph.exporters.ort.weights.nbits import SHIPPED
from tfgraph.exporters.ort.weights.quantize import dequantized_source, quantize
from tfgraph.exporters.ort.weights.streamed_reference import (
    is_streamed,
    placements,
    streamed_dequantized,
)
from tfgraph.precision.islands import apply_precision
from tfgraph.sources.quantized_checkpoint import export_block_size


def convert_precision(graph, source, options, shapes, steps) -> dict:
    """Convert ``graph`` in place to ``options.precision``; what the report says of it."""
    return steps.run(
        "ConvertPrecisionPass",
        lambda: apply_precision(
            graph, source, options.precision, keep_io_types=options.keep_io_types, shapes=shapes
        ),
        graph,
        exact=False,
    )


def quantize_weights(graph, source, options, steps) -> tuple:
    """(the graph with ``MatMulNBits`` weights, what the report says of them, the eager
    reference: ``source`` with the dequantized weights, quantizing activations where the
    kernels do)."""
    shipped = source.info.get("quantized_checkpoint")  # AWQ / GPTQ: its own integers
    block_size = export_block_size(shipped, options.weights, options.block_size)
    graph, report = steps.run(
        "MatMulNBitsQuantizer",
        lambda: quantize(
            graph,
            options.weights,
            block_size=block_size,
            symmetric=options.symmetric,
            lm_head=options.quantize_lm_head,
            embeddings=options.quantize_embeddings,
            accuracy_level=options.accuracy_level,
            method=options.weight_method,
            source=source,
            calibration_text=options.calibration_text,
            calibration_tokens=options.calibration_tokens,
            int8_share=options.int8_share,
        ),
        graph,
        exact=False,
    )
    quantized = report.pop("_quantized")
    if shipped:
        report["source_format"] = shipped["format"]
        report["shipped_weights"] = sum(1 for node, _ in quantized if node.meta.get(SHIPPED))
        if block_size != options.block_size:
            report["block_size_note"] = (
                f"the checkpoint's group size: --block-size {options.block_size} overridden"
            )
    if is_streamed(source):  # a checkpoint's weights: streamed, dequantized per block
        placed = placements(quantized)
        nodes = {n.name: n for n in graph.graph}
        reference = streamed_dequantized(source, placed, nodes, graph.graph.initializers)
    else:
        reference, placed = dequantized_source(source, quantized, graph)
    report["parameters"] = placed
    return graph, report, reference


def quantize_kv_cache(graph, source, options, shapes, steps, scratch: Path):
    """The cache of ``graph`` in int8 (:mod:`tfgraph.exporters.ort.int8_kv`): scales measured on
    the parity inputs, the fake-quantized fp32 reference written to ``scratch/model.onnx``
    for parity (a large graph's without its weights: parity links the artifact's); (what the
    report says, the reference's path)."""
    from tfgraph.exporters.ort.int8_kv import (
        FakeQuantized,
        cached_layers,
        calibrate,
        kv_quantization,
        save_reference,
        scales_of,
        to_int8,
    )
    from tfgraph.precision.islands import island_feeds

    path = scratch / "model.onnx"

    def rewrite() -> None:
        layers = cached_layers(graph)
        ranges = calibrate(graph, island_feeds(graph, source, shapes), options.kv_scales)
        scales = scales_of(ranges)
        reference = FakeQuantized(graph, layers, scales)
        try:
            save_reference(graph, path)
        finally:
            reference.undo()
        to_int8(graph, layers, scales, options.kv_scales, ranges)

    steps.run("QuantizeKVCachePass", rewrite, graph, exact=False)
    return kv_quantization(graph), path
