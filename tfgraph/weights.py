"""Weight-only int8 / int4 quantization (``--weights``): ``com.microsoft.MatMulNBits``.

ONNX Runtime's own quantizer (``onnxruntime.quantization.matmul_nbits_quantizer``) turns every
``MatMul`` with a constant 2-D weight into ``MatMulNBits``: block-wise along the reduction
axis K, one scale (and, asymmetric, one zero point) per block of ``block_size`` rows and per
output column. Block sizes are powers of two ≥ 16 (ONNX Runtime rejects 8 at session
creation; measured).

- **LM head**: quantized unless ``lm_head=False``. A head tied to the embedding reads the
  embedding through a ``Transpose``; it gets its own transposed copy to quantize (the embedding
  ``Gather`` keeps the fp32 table).
- **Gemm** (GPT-2's ``Conv1D`` traces to it) becomes ``MatMul`` first
  (:mod:`tfgraph.passes.gemm_as_matmul`): the quantizer takes MatMuls only.
- **Embeddings** stay fp32 (a ``Gather`` reads one row per token; nothing to gain in decode).
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

import contextlib
import logging

import numpy as np
import onnx_ir as ir

from tfgraph import contract

from .errors import TfgraphError
from .passes.gemm_as_matmul import gemm_as_matmul
from .passes.provenance import layer_name

logger = logging.getLogger(__name__)

WEIGHT_FORMATS = {"int8": 8, "int4": 4}
DEFAULT_BLOCK_SIZE = 32
MIN_BLOCK_SIZE = 16


def check_weights(
    weights: str | None, block_size: int, target, accuracy_level: int | None = None
) -> int:
    """Refuse a format the target cannot run or a block size the kernel rejects; the accuracy
    level to use (``None``: the target's default)."""
    if weights is None:
        return 0
    if weights not in WEIGHT_FORMATS:
        raise TfgraphError(
            f"unknown --weights '{weights}': choose one of {', '.join(WEIGHT_FORMATS)}"
        )
    if weights not in target.weight_formats:
        supported = ", ".join(target.weight_formats) or "none"
        raise TfgraphError(
            f"target '{target.label}' does not run --weights {weights} (MatMulNBits is an ONNX "
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
    array = np.ascontiguousarray(np.transpose(table.const_value.numpy(), perm))
    value = ir.Value(
        name=f"{table.name}__head", const_value=ir.tensor(array), shape=ir.Shape(array.shape)
    )
    value.type = ir.TensorType(ir.DataType.FLOAT)
    model.graph.register_initializer(value)
    head.replace_input_with(1, value)
    return True


def quantize(
    model: ir.Model,
    weights: str,
    *,
    block_size: int,
    symmetric: bool,
    lm_head: bool,
    accuracy_level: int = 0,
) -> tuple[ir.Model, dict]:
    """``model`` with its MatMul weights in ``MatMulNBits``; and what the report says: the
    quantized and unquantized layers, weight bytes before and after, and under
    ``"_dequantized"`` ``{MatMulNBits node: ((K, N) original, (K, N) dequantized)}``."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    bits = WEIGHT_FORMATS[weights]
    if bits == 8 and accuracy_level == 0:
        logger.warning(
            "--weights int8 at accuracy level 0: ONNX Runtime 1.32's CPU MatMulNBits with fp32 "
            "activations measured 16-17x slower than fp32 MatMul (docs/precision.md); level 4 "
            "(the default on the CPU) is not"
        )
    gemm_as_matmul(model)  # the quantizer takes MatMuls only (GPT-2's Conv1D is a Gemm)
    head = _logits_head(model)
    unquantized = []
    if head is not None and lm_head:
        _untie_head(model, head)
    originals, provenance = {}, {}
    for node in model.graph:
        if node.op_type == "MatMul" and node.inputs[1].const_value is not None:
            originals[node.name] = (node.inputs[1].name, node.inputs[1].const_value.numpy())
            provenance[node.name] = dict(node.metadata_props)
    before = _weight_bytes(model)
    exclude = [head.name] if head is not None and not lm_head else []
    if exclude:
        unquantized.append(
            {"module": layer_name(head), "reason": "LM head (--no-quantize-lm-head)"}
        )
    proto = ir.serde.serialize_model(model)
    quantizer = MatMulNBitsQuantizer(
        proto,
        bits=bits,
        block_size=block_size,
        is_symmetric=symmetric,
        accuracy_level=accuracy_level,
        nodes_to_exclude=exclude,
    )
    quantizer.process()
    quantized_model = ir.serde.deserialize_model(quantizer.model.model)
    quantized, dequant = [], {}
    initializers = quantized_model.graph.initializers
    for node in quantized_model.graph:
        if node.op_type != "MatMulNBits":
            continue
        base = node.name.removesuffix(f"_Q{bits}")  # the quantizer's name for the MatMul's
        if base not in originals:
            continue
        name, original = originals.pop(base)
        node.metadata_props.update(provenance[base])  # the quantizer drops the module scopes
        dequant[node.name] = (original, dequantize(node, initializers, original.shape))
        quantized.append({"module": layer_name(node), "shape": list(original.shape)})
    for name in originals:  # MatMuls with constant weights the quantizer left alone
        unquantized.append({"node": name, "reason": "not taken by the quantizer"})
    for node in quantized_model.graph:
        if node.op_type == "Gather" and node.inputs[0].const_value is not None:
            unquantized.append({"module": layer_name(node), "reason": "embedding (stays fp32)"})
    return quantized_model, {
        "weights": weights,
        "block_size": block_size,
        "symmetric": symmetric,
        "accuracy_level": accuracy_level,
        "lm_head": bool(lm_head and head is not None),
        "quantized": quantized,
        "unquantized": unquantized,
        "weight_bytes_before": before,
        "weight_bytes_after": _weight_bytes(quantized_model),
        "_dequantized": dequant,
    }


def _weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value)


def dequantize(node: ir.Node, initializers, shape: tuple[int, int]) -> np.ndarray:
    """The (K, N) weight ``MatMulNBits`` computes with: ``(q − zero_point) · scale`` per block.

    Layout (ONNX Runtime's contrib op): ``B`` (N, blocks, block·bits/8) uint8, values packed
    low bits first; ``scales`` (N·blocks); ``zero_points`` packed the same way along blocks,
    absent for symmetric weights (then 2^(bits−1)).
    """
    bits = node.attributes.get_int("bits", 4)
    block = node.attributes.get_int("block_size")
    k, n = shape
    packed = initializers[node.inputs[1].name].const_value.numpy()
    scales = initializers[node.inputs[2].name].const_value.numpy().astype(np.float32)
    blocks = packed.shape[1]
    q = _unpack(packed.reshape(n, -1), bits).reshape(n, blocks, block).astype(np.float32)
    zp_value = node.inputs[3] if len(node.inputs) > 3 else None
    if zp_value is not None and zp_value.name:
        zp = initializers[zp_value.name].const_value.numpy()
        zp = _unpack(zp.reshape(n, -1), bits)[:, :blocks].astype(np.float32)
    else:
        zp = np.full((n, blocks), 2 ** (bits - 1), np.float32)
    w = (q - zp[:, :, None]) * scales.reshape(n, blocks)[:, :, None]  # (N, blocks, block)
    return np.ascontiguousarray(w.reshape(n, -1)[:, :k].T)  # (K, N)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 bytes → values of ``bits`` bits, low bits first, along the last axis."""
    if bits == 8:
        return packed
    low, high = packed & 0x0F, packed >> 4
    return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)


def locate(module, dequantized: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[dict]:
    """Where each quantized (K, N) matrix came from in ``module``, found by its original's
    content: one ``{node, parameter, columns, transposed}`` per column block (the report keeps
    them, so the reference can be rebuilt from the artifact). A matrix found nowhere raises
    (the reference would be wrong)."""
    columns: dict[bytes, list] = {}
    for pname, param in module.named_parameters():
        if param.ndim != 2:
            continue
        data = param.detach().float().numpy()
        for transposed in (True, False):  # Linear (out, in) is Wᵀ; Conv1D (in, out) is W
            view = data.T if transposed else data
            columns.setdefault(np.ascontiguousarray(view[:, 0]).tobytes(), []).append(
                (pname, transposed, view)
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
            held = _write(module, params[entry["parameter"]], block)
            if entry["node"] in activation_blocks:
                for param in held:
                    blocks[param.untyped_storage().data_ptr()] = activation_blocks[entry["node"]]
    if blocks:
        module._tfgraph_activation_quantizer = ActivationQuantizer(blocks)
        module._tfgraph_activation_quantizer.install(module)
    return dataclasses.replace(source, module=module, info=dict(source.info))


def _write(module, param, array: np.ndarray) -> list:
    """Give ``param``'s users ``array``; the parameters that now hold it. A parameter an
    embedding shares with the LM head (tied weights) is untied: the head gets the new values,
    the embedding keeps its table, as the graph does (:func:`_untie_head`)."""
    import torch
    from torch import nn

    holders = [(m, key) for m in module.modules() for key, p in m._parameters.items() if p is param]
    if len(holders) == 1:
        param.copy_(torch.from_numpy(array))
        return [param]
    held = []
    for holder, key in holders:
        if not isinstance(holder, nn.Embedding):
            holder._parameters[key] = nn.Parameter(torch.from_numpy(array), requires_grad=False)
            held.append(holder._parameters[key])
    return held


class ActivationQuantizer:
    """The activation side of an accuracy-level-4 ``MatMulNBits`` in eager PyTorch: while the
    module runs, the left operand of every ``linear`` / ``matmul`` / ``addmm`` whose weight is
    one of the quantized parameters (matched by storage, so ``w.T`` and views count) is
    replaced by its int8 fake-quantization per block along K: ``round(x / s) · s`` with
    ``s = max|x| / 127`` over each block (a partial last block as if zero-padded)."""

    def __init__(self, blocks: dict[int, int]):
        self.blocks = blocks
        self.enabled = True  # off: the reference without activation quantization

    def install(self, module) -> None:
        """Run ``module``'s forward calls under the quantizing mode."""
        mode = self.mode()

        def enter(_module, _args):
            mode.__enter__()  # a pre-hook returning a value would replace the arguments

        def leave(_module, _args, _output):
            mode.__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)

    def mode(self):
        import torch
        import torch.nn.functional as F
        from torch.overrides import TorchFunctionMode

        blocks, quantizer = self.blocks, self
        # function → (index of the activation, index of the weight) in its positional args
        operands = {
            F.linear: (0, 1),
            torch.matmul: (0, 1),
            torch.Tensor.matmul: (0, 1),
            torch.Tensor.__matmul__: (0, 1),
            torch.mm: (0, 1),
            torch.bmm: (0, 1),
            torch.addmm: (1, 2),
        }

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                where = operands.get(func)
                if quantizer.enabled and where is not None and len(args) > where[1]:
                    weight = args[where[1]]
                    block = blocks.get(weight.untyped_storage().data_ptr())
                    if block is not None:
                        args = list(args)
                        args[where[0]] = fake_quantize(args[where[0]], block)
                return func(*args, **kwargs)

        return Mode()


ACTIVATION_FACTOR = 2.0


def activation_rule() -> dict:
    """The passing rule of an artifact whose kernels quantize activations, for reports."""
    return {
        "factor": ACTIVATION_FACTOR,
        "rule": f"max|export - reference| <= {ACTIVATION_FACTOR:g} x max|reference without "
        "activation quantization - reference| + the fp32 tolerance at the output's scale",
    }


def quantizes_activations(source) -> bool:
    """Whether ``source`` is the eager reference of kernels that quantize activations."""
    return hasattr(source.module, "_tfgraph_activation_quantizer")


@contextlib.contextmanager
def activation_quantization_off(source):
    """Within: ``source``'s eager module computes without its activation quantization."""
    quantizer = getattr(source.module, "_tfgraph_activation_quantizer", None)
    if quantizer is None:
        yield
        return
    quantizer.enabled = False
    try:
        yield
    finally:
        quantizer.enabled = True


def without_activation_quantization(source, inputs: dict) -> dict | None:
    """``source``'s eager outputs with its activation quantization off; None without one."""
    if not quantizes_activations(source):
        return None
    with activation_quantization_off(source):
        return source.eager(inputs)


def judge_activations(got, want, plain, keep=None) -> dict:
    """One output of an artifact whose MatMulNBits quantize activations (accuracy level 4)
    against the reference that quantizes them alike (``want``) and the same reference without
    that quantization (``plain``).

    Rounding to int8 is discontinuous: fp32 noise of the order of 1e-7 in an activation flips
    the rounding of an element that sits at a half step, and one flip moves the output by
    about as much as the whole activation quantization does (measured: a perturbation of
    1e-6 relative moved gpt2-tiny's logits by 0.13 where all of the activation quantization
    moved them by 0.16). Exact parity is not to be had; the artifact passes when it is within
    :data:`ACTIVATION_FACTOR` times the activation quantization's own effect (plus the fp32
    tolerance): a wrong weight, scale or layer moves outputs by the weight quantization's
    error or more, 20x that effect on the zoo's tiny presets."""
    from .parity import FP32

    got, want, plain = (np.asarray(a, np.float64) for a in (got, want, plain))
    if keep is not None and got.shape[:2] == keep.shape and not keep.all():
        got, want, plain = got[keep], want[keep], plain[keep]
    if got.shape != want.shape:
        return {"passed": False, "error": f"shape {got.shape} != eager {want.shape}"}
    scale = float(np.abs(want).max()) if want.size else 0.0
    err = float(np.abs(got - want).max()) if got.size else 0.0
    effect = float(np.abs(plain - want).max()) if plain.size else 0.0
    allowed = ACTIVATION_FACTOR * effect + FP32.atol + FP32.rtol * scale
    finite = bool(np.isfinite(got).all())
    return {
        "max_abs_err": err,
        "max_rel_err": err / scale if scale > 0 else err,
        "activation_quant_err": effect,
        "allowed": allowed,
        "passed": finite and err <= allowed,
    }


def fake_quantize(x, block: int):
    """``x`` quantized to int8 per block of ``block`` along its last axis and back."""
    import torch

    k = x.shape[-1]
    pad = -k % block
    padded = torch.nn.functional.pad(x, (0, pad)) if pad else x
    blocked = padded.reshape(*padded.shape[:-1], -1, block)
    scale = blocked.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale != 0, 1 / torch.where(scale != 0, scale, 1), 0)
    q = torch.round(blocked * inverse).clamp(-127, 127) * scale
    return q.reshape(padded.shape)[..., :k].to(x.dtype)


def _activation_blocks(nodes) -> dict[str, int]:
    """node name → its activation block, for the MatMulNBits nodes at accuracy level 4."""
    return {
        n.name: n.attributes.get_int("block_size")
        for n in nodes
        if n.attributes.get_int("accuracy_level", 0) == 4
    }


def dequantized_source(source, dequantized: dict, model: ir.Model) -> tuple:
    """(a copy of ``source`` whose module computes as ``model``'s MatMulNBits do: the
    dequantized weights, and activations quantized where the nodes say: the eager reference of
    a quantized artifact; where each block went, for the report)."""
    placements = locate(source.module, dequantized)
    logger.info("eager reference: %d parameter blocks set to dequantized values", len(placements))
    matrices = {node: deq for node, (_, deq) in dequantized.items()}
    activations = _activation_blocks(n for n in model.graph if n.name in dequantized)
    return _place(source, placements, matrices, activations), placements


def reference_from_artifact(source, model_file, parameters: list[dict]):
    """The eager reference of a quantized artifact rebuilt from the artifact itself: each
    ``MatMulNBits`` weight dequantized and written where the report's ``parameters`` say, its
    activations quantized as its ``accuracy_level`` says."""
    model = ir.load(model_file)
    nodes = {n.name: n for n in model.graph}
    matrices = {}
    names = {entry["node"] for entry in parameters}
    for name in names:
        node = nodes[name]
        shape = (node.attributes.get_int("K"), node.attributes.get_int("N"))
        matrices[name] = dequantize(node, model.graph.initializers, shape)
    return _place(source, parameters, matrices, _activation_blocks(nodes[n] for n in names))


GREEDY_TOKENS = 64


def quantization_error(source, reference, model_file, shapes) -> dict:
    """How far the dequantized model is from the fp32 one: the largest logits difference on
    the parity inputs, and for a cached artifact the greedy tokens of both eager models over
    :data:`GREEDY_TOKENS` steps (how many agree, where they part)."""
    name = source.output_names[0]
    worst, scale = 0.0, 0.0
    for i, (batch, seq) in enumerate(shapes):
        inputs = source.inputs(batch, seq, seed=i)
        want = source.eager(inputs)[name].float().numpy()
        got = reference.eager(inputs)[name].float().numpy()
        worst = max(worst, float(np.abs(got - want).max()))
        scale = max(scale, float(np.abs(want).max()))
    out = {"max_logits_err": worst, "max_logits_rel_err": worst / scale if scale else worst}
    if model_file is None:
        return out
    from tfgraph.runtime import CachedDecoder, open_runner

    from .generation_parity import eager_greedy, encoder_inputs

    decoder = CachedDecoder(open_runner(model_file))
    tokens = source.inputs(1, 8, seed=11)[decoder.token_input].numpy()
    prompts = tokens.tolist()
    steps = GREEDY_TOKENS
    limit = source.info.get("max_positions")
    if limit:
        steps = min(steps, limit - (1 if decoder.seq2seq else tokens.shape[1]))
    extra = encoder_inputs(decoder, prompts) if decoder.seq2seq else {}
    fp32, _ = eager_greedy(source, decoder, prompts, extra, steps)
    deq, _ = eager_greedy(reference, decoder, prompts, extra, steps)
    same = [a == b for a, b in zip(fp32[0], deq[0], strict=True)]
    out["greedy_tokens"] = steps
    out["greedy_agreement"] = sum(same)
    out["greedy_first_difference"] = same.index(False) if False in same else None
    return out
