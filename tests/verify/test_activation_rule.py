"""The activation-quantization parity rule (tfgraph/verify/activation_rule.py): its bound holds
the check's own tolerance, so an int8 KV cache's measured effect (kv_quantization.py widens the
tolerance by it) adds to the int4 kernels' rule instead of being dropped."""

import dataclasses

import numpy as np
import pytest

from tfgraph.verify.activation_rule import ACTIVATION_FACTOR, judge_activations
from tfgraph.verify.tolerance import FP32


def test_the_bound_adds_the_checks_tolerance():
    want = np.array([[1.0, -2.0, 0.5]])
    plain = want + np.array([[0.01, 0.0, 0.0]])  # the activation quantization's effect: 0.01
    got = want + np.array([[0.0, 0.05, 0.0]])  # beyond 2 x 0.01 + fp32's tolerance
    alone = judge_activations(got, want, plain)
    assert not alone["passed"]
    assert alone["allowed"] == pytest.approx(ACTIVATION_FACTOR * 0.01 + FP32.atol + FP32.rtol * 2)
    kv = dataclasses.replace(FP32, atol=FP32.atol + 2 * 0.02)  # an int8 cache's effect 0.02
    widened = judge_activations(got, want, plain, tolerance=kv)
    assert widened["passed"] and widened["allowed"] == pytest.approx(alone["allowed"] + 0.04)
    far = judge_activations(want + 0.2, want, plain, tolerance=kv)  # a wrong kernel
    assert not far["passed"]
