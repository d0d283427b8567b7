"""Weight-only int8 / int4 quantization (``--weights``): ``com.microsoft.MatMulNBits``.

ONNX Runtime's own quantizer (``onnxruntime.quantization.matmul_nbits_quantizer``) turns every
``MatMul`` with a constant 2-D weight into ``MatMulNBits``: block-wise along the reduction
axis K, one scale (and, asymmetric, one zero point) per block of ``block_size`` rows and per
output column. Block sizes are powers of two ≥ 16 (ONNX Runtime rejects 8 at session
creation; measured).

- **LM head**: quantized unless ``lm_head=False``. A head tied to the embedding reads the
  embedding through a ``Transpose``; it gets its own transposed copy to quantize (the embedding
  ``Gather`` keeps its table, quantized on its own as below).
- **Gemm** (GPT-2's ``Conv1D`` traces to it) becomes ``MatMul`` first
  (:mod:`tfgraph.passes.lower.gemm_as_matmul`): the quantizer takes MatMuls only.
- **Embeddings** (int4 only; ``embeddings=False`` keeps them): the ``Gather`` of each
  embedding table becomes ``GatherBlockQuantized``
  (:mod:`tfgraph.exporters.ort.weights.gather_nbits`),
  blocks of ``block_size`` along the hidden axis. A decode step reads one row of it; the
  session no longer holds the fp32 table (the largest fp32 weight left in an int4 Llama).
  int8 keeps them fp32 (ONNX Runtime's Gather quantization is 4 bits only).
- **Accuracy level** (the kernel's ``accuracy_level``; the target lists what it runs, default
  first): 4 quantizes each activation row to int8 per block of ``block_size`` along K
  (symmetric, scale ``max|x| / 127``, round half to even) and multiplies in integers; 0 keeps
  fp32 activations. Level 4 is the CPU provider's fast path (int4 about 2x, int8 about 35x
  faster per MatMul than level 0 here; docs/precision.md).
- **The reference**: :func:`dequantize` returns the weights as the kernel computes with them,
  ``(q − zero_point) · scale``, so :func:`dequantized_source` can give the eager model exactly
  those weights, and at level 4 quantizes the activations entering those weights the same way
  the kernel does (:class:`ActivationQuantizer`; measured against the kernel: 3e-6 on a
  768x768 MatMul): parity against it is exact up to fp32 noise. Each quantized matrix is found
  among the module's parameters by content (a ``Linear``'s weight transposed, GPT-2's
  ``Conv1D`` as it is, or a column block of a packed Q/K/V).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx_ir as ir

from tfgraph import contract
from tfgraph.errors import TfgraphError
from tfgraph.exporters.ort.weights.activations import ActivationQuantizer
from tfgraph.exporters.ort.weights.calibration import DEFAULT_TOKENS
from tfgraph.exporters.ort.weights.dequantize import dequantize
from tfgraph.exporters.ort.weights.gather_nbits import dequantize_table, quantize_embeddings
from tfgraph.exporters.ort.weights.methods import check_method
from tfgraph.exporters.ort.weights.mixed import DEFAULT_INT8_SHARE, check_share, plan_nodes
from tfgraph.exporters.ort.weights.nbits import quantizable, quantize_matmuls
from tfgraph.exporters.ort.weights.streamed_reference import is_streamed, streamed_dequantized
from tfgraph.passes.lazy_weights import transposed
from tfgraph.passes.lower.gemm_as_matmul import gemm_as_matmul
from tfgraph.passes.provenance import layer_name
from tfgraph.passes.rewrite_utils import weight_bytes

logger = logging.getLogger(__name__)

WEIGHT_FORMATS = {"int8": 8, "int4": 4, "mixed": 4}  # mixed: int4 and int8 (mixed.py)
NEEDS_CALIBRATION = "--calibration-text"
DEFAULT_BLOCK_SIZE = 32
MIN_BLOCK_SIZE = 16


def check_weights(
    weights: str | None,
    block_size: int,
    target,
    accuracy_level: int | None = None,
    method: str = "rtn",
    calibration_text: str | None = None,
    int8_share: float = DEFAULT_INT8_SHARE,
) -> int:
    """Refuse a format the target cannot run, a block size the kernel rejects, a method that
    cannot make the format or lacks its calibration text; the accuracy level to use (``None``:
    the target's default)."""
    if weights is None:
        if method != "rtn" or calibration_text is not None:
            raise TfgraphError(
                "--method and --calibration-text choose how --weights quantizes: add --weights "
                "int4 (or int8, mixed)"
            )
        return 0
    if weights not in WEIGHT_FORMATS:
        raise TfgraphError(
            f"unknown --weights '{weights}': choose one of {', '.join(WEIGHT_FORMATS)}"
        )
    check_method(method, 8 if weights == "int8" else 4)
    check_share(int8_share)
    if (method == "gptq" or weights == "mixed") and calibration_text is None:
        what = "--method gptq" if method == "gptq" else "--weights mixed"
        raise TfgraphError(
            f"{what} measures the weights' inputs on text: give {NEEDS_CALIBRATION} FILE (a "
            "few thousand tokens of text like the model's)"
        )
    formats = ("int4", "int8") if weights == "mixed" else (weights,)
    missing = [f for f in formats if f not in target.weight_formats]
    if missing:
        supported = ", ".join(target.weight_formats) or "none"
        raise TfgraphError(
            f"target '{target.label}' does not run --weights {missing[0]} (MatMulNBits is an ONNX "
            f"Runtime kernel): use --target ort or ort-cuda (this target takes: {supported})"
        )
    if block_size < MIN_BLOCK_SIZE or block_size & (block_size - 1):
        raise TfgraphError(
            f"--block-size {block_size} is not supported: use a power of two ≥ {MIN_BLOCK_SIZE} "
            "(MatMulNBits rejects others)"
        )
    levels = target.weight_accuracy_levels
    if accuracy_level is None:
        return levels[0]
    if accuracy_level not in levels:
        raise TfgraphError(
            f"--accuracy-level {accuracy_level} is not run by target '{target.label}': use one "
            f"of {', '.join(map(str, levels))}"
        )
    return accuracy_level


def _logits_head(model: ir.Model) -> ir.Node | None:
    """The MatMul that computes the logits output (through a bias Add, if any)."""
    names = set(contract.names_with_role(model, contract.LOGITS))
    for value in model.graph.outputs:
        if value.name not in names:
            continue
        node = value.producer()
        if node is not None and node.op_type == "Add":
            node = next((i.producer() for i in node.inputs if i.producer() is not None), None)
        if node is not None and node.op_type == "MatMul":
            return node
    return None


def _untie_head(model: ir.Model, head: ir.Node) -> bool:
    """A head reading ``Transpose(embedding table)`` gets the transposed table as its own
    initializer, so that the quantizer sees a constant weight."""
    weight = head.inputs[1]
    node = weight.producer()
    if node is None or node.op_type != "Transpose":
        return False
    table = node.inputs[0]
    if table.const_value is None:
        return False
    perm = node.attributes.get_ints("perm", [1, 0])
    value = transposed(model.graph, f"{table.name}__head", table.const_value, perm)
    head.replace_input_with(1, value)
    if not node.outputs[0].uses() and not node.outputs[0].is_graph_output():
        # else the dead Transpose kept the fp32 table in the artifact beside its quantized
        # copies (a 250k-word vocabulary: 4.1 GB written, and opened by the session)
        model.graph.remove(node, safe=True)
    return True


def quantize(
    model: ir.Model,
    weights: str,
    *,
    block_size: int,
    symmetric: bool,
    lm_head: bool,
    accuracy_level: int = 0,
    embeddings: bool = True,
    method: str = "rtn",
    source=None,
    calibration_text: str | None = None,
    calibration_tokens: int = DEFAULT_TOKENS,
    int8_share: float = DEFAULT_INT8_SHARE,
) -> tuple[ir.Model, dict]:
    """``model`` with its MatMul weights in ``MatMulNBits``; and what the report says: the
    quantized and unquantized layers, weight bytes before and after, and under
    ``"_quantized"`` the ``(MatMulNBits node, original weight value)`` pairs. The new weights
    are lazy (:mod:`tfgraph.exporters.ort.weights.nbits`): quantized when written, each by
    ``method`` (:mod:`tfgraph.exporters.ort.weights.methods`); gptq and ``weights="mixed"``
    measure ``source``'s inputs on ``calibration_tokens`` of ``calibration_text``."""
    bits = WEIGHT_FORMATS[weights]
    _warn_slow(bits, accuracy_level)
    gemm_as_matmul(model)  # the quantizer takes MatMuls only (GPT-2's Conv1D is a Gemm)
    head = _logits_head(model)
    unquantized = []
    if head is not None and lm_head:
        _untie_head(model, head)
    before = weight_bytes(model)
    exclude = [head.name] if head is not None and not lm_head else []
    if exclude:
        unquantized.append(
            {"module": layer_name(head), "reason": "LM head (--no-quantize-lm-head)"}
        )
    how = {"weights": weights, "method": method, "block": block_size, "symmetric": symmetric}
    how.update(level=accuracy_level, text=calibration_text, tokens=calibration_tokens)
    how["share"] = int8_share
    plan, extra = plan_nodes(quantizable(model, exclude), how, source, locate)
    done = quantize_matmuls(
        model,
        bits,
        block_size=block_size,
        symmetric=symmetric,
        accuracy_level=accuracy_level,
        exclude=exclude,
        plan=plan,
    )
    quantized_model = model
    quantized = [
        {
            "module": layer_name(node),
            "shape": [int(d) for d in weight.shape],
            "bits": node.attributes.get_int("bits", bits),
        }
        for node, weight in done
    ]
    if embeddings and bits == 4:
        tables = quantize_embeddings(model, block_size=block_size, symmetric=symmetric)
        quantized += [
            {"module": layer_name(node), "shape": [int(d) for d in table.shape], "op": "Gather"}
            for node, table in tables
        ]
        done += tables
    unquantized += _left(quantized_model, exclude, bits, embeddings)
    return quantized_model, {
        "weights": weights,
        "block_size": block_size,
        "symmetric": symmetric,
        **extra,
        "accuracy_level": accuracy_level,
        "lm_head": bool(lm_head and head is not None),
        "embeddings": bool(embeddings and bits == 4),
        "quantized": quantized,
        "unquantized": unquantized,
        "weight_bytes_before": before,
        "weight_bytes_after": weight_bytes(quantized_model),
        "_quantized": done,
    }


def _warn_slow(bits: int, accuracy_level: int) -> None:
    if bits == 8 and accuracy_level == 0:
        logger.warning(
            "--weights int8 at accuracy level 0: ONNX Runtime 1.32's CPU MatMulNBits with fp32 "
            "activations measured 16-17x slower than fp32 MatMul (docs/precision.md); level 4 "
            "(the default on the CPU) is not"
        )


def _left(model: ir.Model, exclude: list, bits: int, embeddings: bool) -> list[dict]:
    """The report's rows for the constant MatMuls and Gathers left unquantized, and why."""
    rows = []
    for node in model.graph:
        if (
            node.op_type == "MatMul"
            and node.inputs[1] is not None
            and node.inputs[1].is_initializer()
        ):
            if node.name not in exclude:
                rows.append({"node": node.name, "reason": "not taken by the quantizer"})
    for node in model.graph:
        if node.op_type == "Gather" and node.inputs[0].const_value is not None:
            rows.append({"module": layer_name(node), "reason": _kept_gather(bits, embeddings)})
    return rows


def _kept_gather(bits: int, embeddings: bool) -> str:
    if bits != 4:
        return "embedding (int8: ONNX Runtime quantizes a Gather to 4 bits only)"
    if not embeddings:
        return "embedding (--no-quantize-embeddings)"
    return "not an fp32/fp16 embedding table (the ones GatherBlockQuantized takes)"


def locate(
    module, dequantized: dict[str, tuple[np.ndarray, np.ndarray]], rounding=None
) -> list[dict]:
    """Where each quantized (K, N) matrix came from in ``module``, found by its original's
    content: one ``{node, parameter, columns, transposed}`` per column block (the report keeps
    them, so the reference can be rebuilt from the artifact). A matrix found nowhere raises
    (the reference would be wrong). ``rounding``: the numpy dtype the originals were converted
    to (``--precision fp16``), which the parameters are compared through."""
    columns: dict[bytes, list] = {}
    for pname, param in module.named_parameters():
        if param.ndim != 2:
            continue
        data = param.detach().float().numpy()
        if rounding is not None:
            data = data.astype(rounding).astype(np.float32)
        for flipped in (True, False):  # Linear (out, in) is Wᵀ; Conv1D (in, out) is W
            view = data.T if flipped else data
            columns.setdefault(np.ascontiguousarray(view[:, 0]).tobytes(), []).append(
                (pname, flipped, view)
            )
    found = []
    for name, (original, _) in dequantized.items():
        col = 0
        while col < original.shape[1]:
            key = np.ascontiguousarray(original[:, col]).tobytes()
            match = next(
                (
                    (pname, transposed, view.shape[1])
                    for pname, transposed, view in columns.get(key, [])
                    if col + view.shape[1] <= original.shape[1]
                    and np.array_equal(original[:, col : col + view.shape[1]], view)
                ),
                None,
            )
            if match is None:
                raise TfgraphError(
                    f"cannot find the parameter of quantized weight '{name}' (columns from "
                    f"{col}) in the module: the eager reference would not match"
                )
            pname, transposed, width = match
            found.append(
                {
                    "node": name,
                    "parameter": pname,
                    "columns": [col, col + width],
                    "transposed": transposed,
                }
            )
            col += width
    return found


def _place(
    source,
    placements: list[dict],
    matrices: dict[str, np.ndarray],
    activation_blocks: dict[str, int],
):
    """A copy of ``source`` whose module holds ``matrices`` (by MatMulNBits node, (K, N))
    where ``placements`` say, and quantizes the activations entering the nodes named in
    ``activation_blocks`` (node → block along K) as an accuracy-level-4 kernel does."""
    import copy
    import dataclasses

    import torch

    module = copy.deepcopy(source.module)
    params = dict(module.named_parameters())
    blocks: dict[int, int] = {}
    with torch.no_grad():
        for entry in placements:
            c0, c1 = entry["columns"]
            block = matrices[entry["node"]][:, c0:c1]
            block = np.ascontiguousarray(block.T if entry["transposed"] else block)
            held = _write(module, params[entry["parameter"]], block, entry.get("embedding", False))
            if entry["node"] in activation_blocks:
                for param in held:
                    blocks[param.untyped_storage().data_ptr()] = activation_blocks[entry["node"]]
    if blocks:
        module._tfgraph_activation_quantizer = ActivationQuantizer(blocks)
        module._tfgraph_activation_quantizer.install(module)
    return dataclasses.replace(source, module=module, info=dict(source.info))


def _write(module, param, array: np.ndarray, embedding: bool = False) -> list:
    """Give ``param``'s users ``array``; the parameters that now hold it. A parameter an
    embedding shares with the LM head (tied weights) is untied, as in the graph
    (:func:`_untie_head`): the head's values go to the head, the embedding's (a quantized
    table, ``embedding``) to the embedding; the other keeps the original."""
    import torch
    from torch import nn

    holders = [(m, key) for m in module.modules() for key, p in m._parameters.items() if p is param]
    if len(holders) == 1:
        param.copy_(torch.from_numpy(array))
        return [param]
    held = []
    for holder, key in holders:
        if isinstance(holder, nn.Embedding) == embedding:
            holder._parameters[key] = nn.Parameter(torch.from_numpy(array), requires_grad=False)
            held.append(holder._parameters[key])
    return held


def _activation_blocks(nodes) -> dict[str, int]:
    """node name → its activation block, for the MatMulNBits nodes at accuracy level 4."""
    return {
        n.name: n.attributes.get_int("block_size")
        for n in nodes
        if n.attributes.get_int("accuracy_level", 0) == 4
    }


def dequantized_source(source, quantized: list, model: ir.Model) -> tuple:
    """(a copy of ``source`` whose module computes as ``model``'s MatMulNBits do: the
    dequantized weights, and activations quantized where the nodes say: the eager reference of
    a quantized artifact; where each block went, for the report)."""
    initializers = model.graph.initializers
    dequantized = {}
    tables = set()
    rounding = None
    for node, weight in quantized:
        original = weight.const_value.numpy()
        if original.dtype != np.float32:  # converted by --precision: found by its rounded values
            rounding = original.dtype
            original = original.astype(np.float32)
        dequantized[node.name] = (original, _dequantized(node, initializers))
        if node.op_type == "GatherBlockQuantized":
            tables.add(node.name)
    placements = locate(source.module, dequantized, rounding)
    for entry in placements:
        if entry["node"] in tables:
            entry["embedding"] = True
    logger.info("eager reference: %d parameter blocks set to dequantized values", len(placements))
    matrices = {node: deq for node, (_, deq) in dequantized.items()}
    activations = _activation_blocks(n for n in model.graph if n.name in dequantized)
    return _place(source, placements, matrices, activations), placements


def _dequantized(node: ir.Node, initializers) -> np.ndarray:
    """What a quantized node computes with: a MatMulNBits' (K, N) weight, a
    GatherBlockQuantized's (rows, width) table."""
    if node.op_type == "GatherBlockQuantized":
        return dequantize_table(node, initializers)
    shape = (node.attributes.get_int("K"), node.attributes.get_int("N"))
    return dequantize(node, initializers, shape)


def reference_from_artifact(source, model_file, parameters: list[dict]):
    """The eager reference of a quantized artifact rebuilt from the artifact itself: each
    ``MatMulNBits`` weight dequantized and written where the report's ``parameters`` say, its
    activations quantized as its ``accuracy_level`` says."""
    model = ir.load(model_file)
    nodes = {n.name: n for n in model.graph}
    if is_streamed(source):
        return streamed_dequantized(source, parameters, nodes, model.graph.initializers)
    matrices = {}
    names = {entry["node"] for entry in parameters}
    for name in names:
        matrices[name] = _dequantized(nodes[name], model.graph.initializers)
    return _place(source, parameters, matrices, _activation_blocks(nodes[n] for n in names))
