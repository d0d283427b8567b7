"""Calibration Hessians (``--method gptq``, ``--weights mixed``): computed in groups of modules
within a memory budget (a 7B's do not fit at once), they are the same as in one pass."""

import numpy as np
import pytest
import torch

from tfgraph.errors import TfgraphError
from tfgraph.exporters.ort.weights.calibration import (
    Calibrator,
    budget_groups,
    calibration_windows,
    tokens_of,
)
from tfgraph.sources import load_source


@pytest.fixture(scope="module")
def calibrated(tiny_llama_dir, calibration_text):
    torch.set_num_threads(1)
    source = load_source(str(tiny_llama_dir))
    windows = calibration_windows(source, calibration_text, tokens=300)
    names = [n for n, m in source.module.named_modules() if isinstance(m, torch.nn.Linear)]
    return source, windows, names


def test_windows_are_the_texts_tokens(calibrated):
    _source, windows, _names = calibrated
    assert tokens_of(windows) == 300
    assert [w["input_ids"].shape[1] for w in windows] == [256, 44]
    assert int(windows[0]["input_ids"].min()) >= 3  # words, not <unk>


def test_grouped_hessians_equal_one_pass(calibrated):
    source, windows, names = calibrated
    whole = Calibrator(source, windows, names)
    one_pass = {name: whole.hessian(name).copy() for name in names}
    assert whole.passes == 1
    small = Calibrator(source, windows, names, budget=2 * 64 * 64 * 8)  # 2 modules a group
    groups = budget_groups(small)
    assert groups > 5
    for name in names:
        np.testing.assert_allclose(small.hessian(name), one_pass[name], rtol=1e-12, atol=0)
    assert small.passes == groups  # asked in order: each group computed once
    assert sum(h.nbytes for h in small._held.values()) <= 128 * 128 * 8  # down_proj alone


def test_shared_inputs_share_a_hessian_and_the_diagonal_is_its_half(calibrated):
    source, windows, names = calibrated
    calibrator = Calibrator(source, windows, names)
    q, k = (f"model.model.layers.0.self_attn.{p}_proj" for p in "qk")
    assert calibrator.hessian(q) is calibrator.hessian(k)  # the same input x
    energies = calibrator.diagonals()
    np.testing.assert_allclose(energies[q], np.diag(calibrator.hessian(q)) / 2, rtol=1e-10)
    assert (energies[q] > 0).all()


def test_a_model_without_a_tokenizer_is_refused(calibration_text):
    source = load_source("llama-tiny")
    with pytest.raises(TfgraphError, match="tokenizer"):
        calibration_windows(source, calibration_text)
