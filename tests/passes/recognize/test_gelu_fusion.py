"""GELU: recognition (``FuseGeluPass``) and lowering per target (``LowerGeluPass``).

Rule unit tests on tiny graphs: exported from tiny torch modules for the forms as people write
them, and from ONNX text for operand orders and the near-misses (one per reason to reject).
Numbers are compared with ONNX Runtime's own optimizations off on both sides.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import random
import warnings
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from ort_run import run_onnx
from torch import nn

from tfgraph.exporters.targets import get_target
from tfgraph.passes.lower.lower_gelu import LowerGeluPass
from tfgraph.passes.pipeline.fusions import op_histogram
from tfgraph.passes.recognize.fuse_gelu import FuseGeluPass, unfused_gelu_candidates
from tfgraph.passes.rewrite_utils import MISS_REASON_KEY

SQRT_2 = math.sqrt(2.0)
SQRT_2_PI = math.sqrt(2.0 / math.pi)
TOLERANCE = {"none": 1e-6, "tanh": 1e-5}
TARGETS = ("ort", "onnx", "tensorrt")


# --- forms as people write them, exported by torch.onnx (dynamo) --------------------------------


class ErfGelu(nn.Module):  # BERT's gelu
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


class ErfGeluHalfRight(nn.Module):
    def forward(self, x):
        return x * 0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


class ErfGeluNested(nn.Module):  # onnxscript's erf_gelu_pattern_2
    def forward(self, x):
        return x * (0.5 * (torch.erf(x / math.sqrt(2.0)) + 1.0))


class ErfGeluHalfLast(nn.Module):  # onnxscript's erf_gelu_pattern_1
    def forward(self, x):
        return 0.5 * (x * (torch.erf(x / math.sqrt(2.0)) + 1.0))


class NewGelu(nn.Module):  # Hugging Face GPT-2 gelu_new
    def __init__(self, cubic: float = 0.044715) -> None:
        super().__init__()
        self.cubic = cubic

    def forward(self, x):
        inner = math.sqrt(2.0 / math.pi) * (x + self.cubic * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


class BloomGelu(nn.Module):  # BLOOM's bloom_gelu_forward
    def forward(self, x):
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


class TorchGelu(nn.Module):  # below opset 20 the exporter writes it out, constants on the left
    def __init__(self, approximate: str) -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x):
        return nn.functional.gelu(x, approximate=self.approximate)


FORMS = {  # name: (module, opset, approximate)
    "erf": (ErfGelu, 20, "none"),
    "erf x*0.5, Mul by 1/sqrt2": (ErfGeluHalfRight, 20, "none"),
    "erf x*(0.5*y)": (ErfGeluNested, 20, "none"),
    "erf 0.5*(x*y)": (ErfGeluHalfLast, 20, "none"),
    "F.gelu at opset 18": (functools.partial(TorchGelu, "none"), 18, "none"),
    "tanh gpt2 gelu_new": (NewGelu, 20, "tanh"),
    "tanh bloom": (BloomGelu, 20, "tanh"),
    "F.gelu tanh at opset 18": (functools.partial(TorchGelu, "tanh"), 18, "tanh"),
}


def _input() -> torch.Tensor:
    return torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0)) * 2


@functools.cache
def _exported(module_factory, opset: int) -> onnx.ModelProto:
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module_factory(), (_input(),), dynamo=True, optimize=True, opset_version=opset
        )
    return ir.serde.serialize_model(program.model)


def _form(name: str) -> ir.Model:
    """A fresh copy of the exported form: the passes work in place."""
    module, opset, _ = FORMS[name]
    return ir.serde.deserialize_model(_exported(module, opset))


def _run(model: ir.Model, x: np.ndarray) -> np.ndarray:
    # log level 3: the initializers the fusion left unused are no news
    return run_onnx(model, x, optimize=False, log_severity=3)[0]


def _gelu_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if (n.domain, n.op_type) == ("tfgraph", "Gelu")]


@pytest.mark.parametrize("name", FORMS)
def test_each_form_fuses_into_one_gelu(name):
    model = _form(name)
    assert FuseGeluPass()(model).modified
    assert op_histogram(model) == Counter({"tfgraph::Gelu": 1})  # no Erf, Tanh, Pow left
    (gelu,) = _gelu_nodes(model)
    assert gelu.attributes.get_string("approximate") == FORMS[name][2]
    assert gelu.metadata_props["pkg.onnxscript.rewriter.rule_name"].startswith("Gelu")
    assert unfused_gelu_candidates(model) == []
    assert not FuseGeluPass()(model).modified


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", FORMS)
def test_lowered_gelu_matches_original_and_eager(name, target):
    module, _, approximate = FORMS[name]
    x = _input()
    original = _run(_form(name), x.numpy())
    model = _form(name)
    FuseGeluPass()(model)
    assert LowerGeluPass(get_target(target))(model).modified
    assert not LowerGeluPass(get_target(target))(model).modified
    onnx.checker.check_model(ir.serde.serialize_model(model), full_check=True)
    lowered = _run(model, x.numpy())
    tol = TOLERANCE[approximate]
    np.testing.assert_allclose(lowered, original, rtol=tol, atol=tol)
    np.testing.assert_allclose(lowered, module()(x).numpy(), rtol=tol, atol=tol)


# --- lowering of the canonical op ----------------------------------------------------------------


def _canonical(approximate: str, opset: int = 20) -> ir.Model:
    return ir.from_onnx_text(f"""
        <ir_version: 10, opset_import: ["" : {opset}, "tfgraph" : 1]>
        g (float[N, 8] x) => (float[N, 8] y) {{
            y = tfgraph.Gelu <approximate = "{approximate}"> (x)
        }}""")


@pytest.mark.parametrize(
    ("target", "opset", "approximate", "expected"),
    [
        ("ort", 20, "none", "com.microsoft::Gelu"),
        ("ort", 20, "tanh", "com.microsoft::FastGelu"),
        ("ort", 18, "tanh", "com.microsoft::FastGelu"),  # contrib ops do not need opset 20
        ("onnx", 20, "none", "Gelu"),
        ("onnx", 20, "tanh", "Gelu"),
        ("tensorrt", 20, "none", "Gelu"),
        ("tensorrt", 20, "tanh", "Gelu"),
    ],
)
def test_lowering_ops_per_target(target, opset, approximate, expected):
    model = _canonical(approximate, opset)
    assert LowerGeluPass(get_target(target))(model).modified
    assert op_histogram(model) == Counter({expected: 1})
    (node,) = model.graph
    if target == "ort":
        assert model.opset_imports["com.microsoft"] == 1
        assert not node.attributes
    else:
        assert "com.microsoft" not in model.opset_imports
        assert node.attributes.get_string("approximate") == approximate
    assert not LowerGeluPass(get_target(target))(model).modified


@pytest.mark.parametrize(
    ("approximate", "expected"),
    [
        ("none", {"Constant": 3, "Mul": 3, "Erf": 1, "Add": 1}),
        ("tanh", {"Constant": 5, "Pow": 1, "Mul": 4, "Add": 2, "Tanh": 1}),
    ],
)
@pytest.mark.parametrize("target", ["onnx", "tensorrt"])
def test_lowering_below_opset_20_expands_and_reports(target, approximate, expected):
    model = _canonical(approximate, opset=18)
    assert LowerGeluPass(get_target(target))(model).modified
    assert op_histogram(model) == Counter(expected)
    (candidate,) = unfused_gelu_candidates(model)
    assert candidate.metadata_props[MISS_REASON_KEY] == "Gelu needs opset 20"
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32) * 2
    eager = nn.functional.gelu(torch.from_numpy(x), approximate=approximate).numpy()
    tol = TOLERANCE[approximate]
    np.testing.assert_allclose(_run(model, x), eager, rtol=tol, atol=tol)
    assert FuseGeluPass()(model).modified  # the expansion is a form the rules know
    assert op_histogram(model) == Counter({"tfgraph::Gelu": 1, "Constant": expected["Constant"]})


def test_lowering_takes_a_target_not_a_name():
    with pytest.raises(TypeError, match="passes take a Target"):
        LowerGeluPass("onnx")


# --- operand orders, groupings, float16, from ONNX text ------------------------------------------

# Each step: (op, a, b, out); a float operand is a scalar initializer.
ERF_DIV = [("Div", "x", SQRT_2, "s"), ("Erf", "s", None, "f")]
ERF_MUL = [("Mul", "x", 1 / SQRT_2, "s"), ("Erf", "s", None, "f")]
GPT2 = [
    ("Pow", "x", 3.0, "p"),
    ("Mul", "p", 0.044715, "c"),
    ("Add", "x", "c", "a"),
    ("Mul", "a", SQRT_2_PI, "s"),
    ("Tanh", "s", None, "f"),
]
BLOOM = [
    ("Mul", "x", 0.044715, "c"),
    ("Mul", "c", "x", "c2"),
    ("Add", "c2", 1.0, "a"),
    ("Mul", "x", SQRT_2_PI, "k"),
    ("Mul", "k", "a", "s"),
    ("Tanh", "s", None, "f"),
]
CORES = {"erf Div": ERF_DIV, "erf Mul": ERF_MUL, "tanh gpt2": GPT2, "tanh bloom": BLOOM}
PRODUCTS = {  # 0.5 · x · y with y = 1 + f
    "(x·0.5)·y": [("Add", "f", 1.0, "y"), ("Mul", "x", 0.5, "h"), ("Mul", "h", "y", "out")],
    "x·(y·0.5)": [("Add", "f", 1.0, "y"), ("Mul", "y", 0.5, "h"), ("Mul", "x", "h", "out")],
    "(x·y)·0.5": [("Add", "f", 1.0, "y"), ("Mul", "x", "y", "h"), ("Mul", "h", 0.5, "out")],
}
X_PRODUCERS = {  # what computes x from the graph input: the rules must not take it for theirs
    "input": [],
    "Add": [("Add", "inp", "inp", "x")],
    "Mul": [("Mul", "inp", "inp", "x")],
    "Mul by constant": [("Mul", "inp", 2.0, "x")],
}


def _text_model(steps, swaps=frozenset(), dtype: str = "float", outputs=("out",)) -> ir.Model:
    """An ONNX-text graph of ``steps``; the binary ops at indices in ``swaps`` swap operands."""
    inits, lines = [], []
    for i, (op, a, b, out) in enumerate(steps):
        args = []
        for operand in (a, b):
            if isinstance(operand, float):
                value = int(operand) if dtype == "int32" else operand
                inits.append(f"{dtype} k{i} = {{{value!r}}}")
                operand = f"k{i}"
            if operand is not None:
                args.append(operand)
        if i in swaps:
            args.reverse()
        lines.append(f"{out} = {op}({', '.join(args)})")
    source = "inp" if any(step[3] == "x" for step in steps) else "x"
    result = ", ".join(f"{dtype}[N] {o}" for o in outputs)
    return ir.from_onnx_text(f"""
        <ir_version: 10, opset_import: ["" : 20]>
        g ({dtype}[N] {source}) => ({result}) <{", ".join(inits)}> {{
            {chr(10).join(lines)}
        }}""")


def _gelu_steps(core="erf Div", product="(x·0.5)·y", replace=None):
    """The steps of a GELU, with constants replaced as ``{old: new}``."""
    steps = CORES[core] + PRODUCTS[product]
    replace = replace or {}
    return [(op, replace.get(a, a), replace.get(b, b), out) for op, a, b, out in steps]


def test_every_operand_order_grouping_and_producer_of_x_fuses():
    """A seeded sample of all combinations (each of them passes; 10 s to run them all)."""
    combinations = [
        (core, product, producer, swaps)
        for core in CORES
        for product in PRODUCTS
        for producer in X_PRODUCERS
        for swaps in _swap_sets(X_PRODUCERS[producer] + _gelu_steps(core, product))
    ]
    failures = []
    for core, product, producer, swaps in random.Random(0).sample(combinations, 300):
        model = _text_model(X_PRODUCERS[producer] + _gelu_steps(core, product), swaps)
        FuseGeluPass()(model)
        if len(_gelu_nodes(model)) != 1:
            failures.append((core, product, producer, sorted(swaps)))
    assert failures == []


def _swap_sets(steps) -> list[frozenset[int]]:
    binary = [i for i, (op, *_) in enumerate(steps) if op in ("Add", "Mul")]
    return [
        frozenset(i for i, bit in zip(binary, bits, strict=True) if bit)
        for bits in np.ndindex(*([2] * len(binary)))
    ]


@pytest.mark.parametrize("core", CORES)
def test_float16_constants_fuse(core):
    """Constants rounded to float16 are within the tolerance of their type."""
    model = _text_model(_gelu_steps(core))
    for value in [*model.graph.inputs, *model.graph.outputs, *model.graph.initializers.values()]:
        value.dtype = ir.DataType.FLOAT16
        if value.const_value is not None:
            array = value.const_value.numpy().astype(np.float16)
            value.const_value = ir.tensor(array, name=value.name)
    assert FuseGeluPass()(model).modified
    assert op_histogram(model) == Counter({"tfgraph::Gelu": 1})


# --- near-misses: one per reason to reject -------------------------------------------------------


def _assert_missed(model: ir.Model, op_type: str, *fragments: str) -> None:
    assert not FuseGeluPass()(model).modified
    assert not _gelu_nodes(model)
    (candidate,) = unfused_gelu_candidates(model)
    assert candidate.op_type == op_type
    reason = candidate.metadata_props[MISS_REASON_KEY]
    for fragment in fragments:
        assert fragment in reason, reason


@pytest.mark.parametrize(
    ("steps", "op_type", "fragments"),
    [
        pytest.param(
            _gelu_steps(replace={0.5: 0.6}),
            "Erf",
            ["the factor 0.5 is 0.6", "expected 0.5"],
            id="half",
        ),
        pytest.param(_gelu_steps(replace={1.0: 2.0}), "Erf", ["the 1 of (1 + f) is 2"], id="one"),
        pytest.param(
            _gelu_steps(replace={SQRT_2: 1.5}),
            "Erf",
            ["the divisor √2", "is 1.5, expected 1.41421356"],
            id="sqrt2",
        ),
        pytest.param(
            _gelu_steps("erf Mul", replace={1 / SQRT_2: 0.75}),
            "Erf",
            ["the factor 1/√2", "is 0.75, expected 0.707106781"],
            id="inv-sqrt2",
        ),
        pytest.param(
            _gelu_steps("tanh gpt2", replace={SQRT_2_PI: 0.8}),
            "Tanh",
            ["the factor √(2/π)", "is 0.8, expected 0.797884561"],
            id="sqrt-2-over-pi",
        ),
        pytest.param(
            _gelu_steps("tanh gpt2", replace={0.044715: 0.05}),
            "Tanh",
            ["the cubic coefficient is 0.05, expected 0.044715"],
            id="cubic",
        ),
        pytest.param(
            _gelu_steps("tanh gpt2", replace={3.0: 2.0}),
            "Tanh",
            ["the exponent of Pow(x, 3) is 2.0, expected 3"],
            id="exponent",
        ),
        pytest.param(
            CORES["tanh bloom"][:2] + [("Add", "c2", 2.0, "a")] + _gelu_steps("tanh bloom")[3:],
            "Tanh",
            ["the 1 of (1 + 0.044715 · x · x) is 2"],
            id="bloom-inner-one",
        ),
        pytest.param(
            ERF_DIV + [("Add", "f", 1.0, "y"), ("Mul", "x", "y", "out")],
            "Erf",
            ["the product is (y)·(x), not 0.5 · x · y"],
            id="no-half",
        ),
    ],
)
def test_near_miss_is_left_with_its_reason(steps, op_type, fragments):
    _assert_missed(_text_model(steps), op_type, *fragments)


def test_near_miss_of_integer_type():
    _assert_missed(_text_model(_gelu_steps(), dtype="int32"), "Erf", "x is INT32")


def test_near_miss_whose_intermediate_has_other_uses():
    model = _text_model(_gelu_steps(), outputs=("out", "y"))  # 1 + erf(·) is a graph output
    _assert_missed(model, "Erf", "other uses")


def test_exported_near_miss_names_the_constant():
    model = ir.serde.deserialize_model(_exported(functools.partial(NewGelu, 0.05), 20))
    _assert_missed(model, "Tanh", "cubic coefficient is 0.05, expected 0.044715")


def test_candidates_are_erf_and_tanh_of_a_cube_only():
    model = ir.from_onnx_text("""
        <ir_version: 10, opset_import: ["" : 20]>
        g (float[N] x) => (float[N] a, float[N] b) <float three = {3.0}> {
            a = Tanh(x)
            p = Pow(x, three)
            b = Tanh(p)
        }""")
    assert [n.outputs[0].name for n in unfused_gelu_candidates(model)] == ["b"]


def test_fused_and_missed_side_by_side():
    """The missed GELU gets its own reason, not one from the GELU next to it."""
    bad = _gelu_steps("tanh gpt2", replace={0.044715: 0.05})
    model = _text_model(_gelu_steps("tanh gpt2") + _renamed(bad), outputs=("out", "bad_out"))
    assert FuseGeluPass()(model).modified
    assert len(_gelu_nodes(model)) == 1
    (candidate,) = unfused_gelu_candidates(model)
    assert "cubic coefficient is 0.05" in candidate.metadata_props[MISS_REASON_KEY]


def _renamed(steps, prefix: str = "bad_"):
    """The steps with every value but ``x`` renamed: a second GELU of the same ``x``."""

    def rename(value):
        return prefix + value if isinstance(value, str) and value != "x" else value

    return [(op, rename(a), rename(b), rename(out)) for op, a, b, out in steps]
