"""Will TensorRT's ONNX parser take this graph? A static check that runs anywhere.

TensorRT cannot be installed on these machines, so before an engine is built (or instead of
building one) each node is checked against what is known of the parser at the chosen version
(``tensorrt@10.14``; plain ``tensorrt`` is 10.15). Every finding names the node, the PyTorch
module it came from and what to do. Two severities:

- ``error``: known not to parse — a ``com.microsoft`` (or any non-standard) op; ``Attention``
  before 10.14, or before 11 with more than one output or a past K/V input (TensorRT parses it
  with a single output: issue 4738); ``RMSNormalization`` before 10.15.
- ``unverified``: not in the parser table known here — ``TensorScatter`` (the static cache's
  write; 10.15 adds a KV-cache-update layer, whether the parser maps TensorScatter onto it is
  not known here), any op outside :data:`PARSED`, and opsets above 23; and the int8 KV
  cache (``--kv-dtype int8``): per-tensor int8 ``QuantizeLinear``/``DequantizeLinear`` (zero
  point 0 of type INT8, fp32 scalar scale) are in the parser's table, but int8 buffers written
  by ``TensorScatter`` and moved by ``Unsqueeze``/``Expand``/``Reshape``/``Transpose`` before
  they are dequantized have not been built into an engine: unverified on TensorRT until a GPU
  machine is lent (parity ran the graph in ONNX Runtime's CPU provider only).

The facts (``../shared/KERNELS.md`` and onnx-tensorrt's operator table) are data here, not
code: :data:`PARSED` and :data:`FIRST_VERSION`.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from tfgraph import contract
from tfgraph.passes.provenance import module_name

# standard ops onnx-tensorrt's table (10.x) lists as parsed, that tfgraph's graphs use
PARSED = frozenset(
    """Abs Add And ArgMax Cast Ceil Clip Concat Constant ConstantOfShape Cos CumSum Div Einsum
    Equal Erf Exp Expand Flatten Floor Gather GatherElements GatherND Gelu Gemm Greater
    GreaterOrEqual Identity If IsInf IsNaN LayerNormalization Less LessOrEqual Log MatMul Max
    Mean Min Mod Mul Neg Not Or Pad Pow Range Reciprocal ReduceMax ReduceMean ReduceMin
    ReduceSum Relu Reshape ScatterElements ScatterND Shape Sigmoid Sign Sin Size Slice Softmax
    Softplus Split Sqrt Squeeze Sub Sum Tanh Tile TopK Transpose Trilu Unsqueeze Where Xor
    Attention RMSNormalization QuantizeLinear DequantizeLinear
    Conv Scan""".split()
)
FIRST_VERSION = {"Attention": (10, 14), "RMSNormalization": (10, 15)}
SINGLE_OUTPUT_ATTENTION_UNTIL = (11,)  # TensorRT issue 4738
MAX_KNOWN_OPSET = 23


@dataclass
class Finding:
    node: str
    op: str
    module: str
    severity: str  # "error" | "unverified"
    reason: str
    fix: str

    def as_dict(self) -> dict:
        return {
            "node": self.node,
            "op": self.op,
            "module": self.module,
            "severity": self.severity,
            "reason": self.reason,
            "fix": self.fix,
        }


def _text(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def check_tensorrt(model: ir.Model, version: tuple[int, ...]) -> list[Finding]:
    """Every node TensorRT ``version``'s parser is known to refuse or not known to take."""
    at = _text(version)
    found: list[Finding] = []
    seen_unknown: set[str] = set()
    for node in model.graph:
        verdict = _node_verdict(node, version, at, seen_unknown)
        if verdict is not None:
            found.append(Finding(node.name, _op_label(node), module_name(node), *verdict))
    return found + _graph_findings(model, at)


def _op_label(node: ir.Node) -> str:
    """The op as a finding names it: with its domain outside the standard one."""
    return f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type


def _node_verdict(node: ir.Node, version, at: str, seen_unknown: set[str]) -> tuple | None:
    """(severity, reason, fix) for a node the parser refuses or is not known to take, else
    None; an op outside :data:`PARSED` is reported at its first node only."""
    op = node.op_type
    if node.domain not in ("", "ai.onnx"):
        return (
            "error",
            f"{node.domain} ops are not TensorRT ops",
            "export with --target tensorrt (standard ops only)",
        )
    first = FIRST_VERSION.get(op)
    if first is not None and version < first:
        fix = (
            f"export with --target tensorrt@{at}: tfgraph lowers it to standard ops there"
            if op == "RMSNormalization"
            else f"export with --target tensorrt@{at} (MatMul-Softmax-MatMul, which TensorRT fuses)"
        )
        return "error", f"TensorRT {at} does not parse {op} ({_text(first)}+ does)", fix
    if op == "Attention" and version < SINGLE_OUTPUT_ATTENTION_UNTIL:
        outputs = [o for o in node.outputs if o is not None and o.name]
        pasts = [v for v in node.inputs[4:6] if v is not None and v.name]
        if len(outputs) > 1 or pasts:
            return (
                "error",
                f"TensorRT {at} parses Attention with one output only (no past or present "
                "K/V: TensorRT issue 4738)",
                f"export with --target tensorrt@{at}: the cache stays outside the op",
            )
        return None
    if op == "TensorScatter":
        return (
            "unverified",
            f"TensorRT {at}'s parser is not known here to take TensorScatter (10.15 adds a "
            "KV-cache-update layer; the mapping is unverified)",
            "build the engine on a GPU machine (tools/gpu_check.sh) to find out",
        )
    if op not in PARSED and op not in seen_unknown:
        seen_unknown.add(op)
        return (
            "unverified",
            f"{op} is not in the parser table known here",
            "build the engine on a GPU machine (tools/gpu_check.sh) to find out",
        )
    return None


def _graph_findings(model: ir.Model, at: str) -> list[Finding]:
    """What is unverified of the graph as a whole: the int8 KV cache, an opset past
    :data:`MAX_KNOWN_OPSET`."""
    opset = model.opset_imports.get("", 0)
    found = []
    if contract.KV_QUANT_KEY in model.metadata_props:
        found.append(
            Finding(
                "",
                "int8 KV cache",
                "",
                "unverified",
                f"TensorRT {at} is not known here to build the int8 KV cache (int8 buffers "
                "written by TensorScatter, moved by Unsqueeze/Expand/Reshape/Transpose, then "
                "DequantizeLinear); only ONNX Runtime's CPU provider ran it",
                "build the engine on a GPU machine (tools/gpu_check.sh) to find out",
            )
        )
    if opset > MAX_KNOWN_OPSET:
        found.append(
            Finding(
                "",
                f"opset {opset}",
                "",
                "unverified",
                f"opset {opset} is above {MAX_KNOWN_OPSET}, the newest known to TensorRT {at}",
                "build the engine on a GPU machine (tools/gpu_check.sh) to find out",
            )
        )
    return found
