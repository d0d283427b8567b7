"""Backend knowledge lives in its target's folder and its runner only (docs/architecture.md):
ONNX Runtime's contrib op names (``com.microsoft`` and its op types) appear as code — string
constants, not docstrings or comments — only in ``exporters/ort/`` and the ORT runner
(``runtime/session.py``); TensorRT's names only in ``exporters/tensorrt/`` and its runner."""

from __future__ import annotations

import ast
from pathlib import Path

from tfgraph.exporters.ort import ops

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("tfgraph", "passes", "exporters", "runtime", "models", "bench")
ORT_HOMES = ("exporters/ort/", "runtime/session.py")
# the op types that exist only as ONNX Runtime contrib ops (a standard ONNX op of the same
# name, like opset 23's Attention or opset 20's Gelu, is not a backend name)
ORT_ONLY = {
    ops.MS_DOMAIN,
    ops.GROUP_QUERY_ATTENTION,
    ops.MULTI_HEAD_ATTENTION,
    ops.PAGED_ATTENTION,
    ops.ROTARY_EMBEDDING,
    ops.SKIP_LAYER_NORM,
    ops.SKIP_SIMPLIFIED_LAYER_NORM,
    ops.SIMPLIFIED_LAYER_NORM,
    ops.FAST_GELU,
    ops.BIAS_GELU,
    ops.MATMUL_NBITS,
    ops.GATHER_BLOCK_QUANTIZED,
    ops.DYNAMIC_QUANTIZE_MATMUL,
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _names_in(path: Path, names: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            found |= {n for n in names if n == node.value or f"{n}." in node.value}
    return found


def _offenders(names: set[str], homes: tuple[str, ...]) -> dict[str, set[str]]:
    out = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel.startswith(homes):
                continue
            if found := _names_in(path, names):
                out[rel] = found
    return out


# Issue 45 left ONNX Runtime's builders of these neutral lowerings in passes/ (it is open for
# them): no file may gain a name, and a file rid of its names must be removed from here.
NOT_YET_MOVED: dict[str, set[str]] = {}


def test_onnx_runtime_names_live_in_the_ort_target_and_runner():
    offenders = _offenders(ORT_ONLY, ORT_HOMES)
    new = {f: n - NOT_YET_MOVED.get(f, set()) for f, n in offenders.items()}
    assert not {f: n for f, n in new.items() if n}, new
    moved = {f: n - offenders.get(f, set()) for f, n in NOT_YET_MOVED.items()}
    assert not {f: n for f, n in moved.items() if n}, f"moved out: update NOT_YET_MOVED: {moved}"


def test_the_check_sees_a_name(tmp_path):
    """The reader finds a contrib op spelled in code, and not one in a docstring."""
    code = tmp_path / "m.py"
    code.write_text('"""GroupQueryAttention in prose."""\nOP = "com.microsoft"\n')
    assert _names_in(code, ORT_ONLY) == {"com.microsoft"}
