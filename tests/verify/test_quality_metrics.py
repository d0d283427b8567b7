"""QualityTally against figures computed by hand (torch's own cross entropy and KL)."""

import math

import numpy as np
import pytest
import torch

from tfgraph.verify.quality_metrics import QualityTally


def test_figures_match_torch_and_add_up_over_windows():
    rng = np.random.default_rng(0)
    ref = rng.normal(size=(40, 50)) * 3
    got = ref + rng.normal(size=ref.shape) * 0.5
    targets = rng.integers(0, 50, size=40)
    tally = QualityTally()
    tally.add(ref[:25], got[:25], targets[:25])  # two windows: the sums carry over
    tally.add(ref[25:], got[25:], targets[25:])
    out = tally.figures()
    t = torch.from_numpy(targets)
    nll_ref = torch.nn.functional.cross_entropy(torch.from_numpy(ref), t).item()
    nll = torch.nn.functional.cross_entropy(torch.from_numpy(got), t).item()
    kl = torch.nn.functional.kl_div(
        torch.log_softmax(torch.from_numpy(got), -1),
        torch.log_softmax(torch.from_numpy(ref), -1),
        log_target=True,
        reduction="none",
    ).sum(-1)
    assert out["ppl_ref"] == pytest.approx(math.exp(nll_ref), rel=1e-9)
    assert out["ppl"] == pytest.approx(math.exp(nll), rel=1e-9)
    assert out["delta_ppl"] == pytest.approx(math.exp(nll) - math.exp(nll_ref), rel=1e-9)
    assert out["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-9)
    assert out["kl_max"] == pytest.approx(kl.max().item(), rel=1e-9)
    top = (ref.argmax(-1) == got.argmax(-1)).mean()
    assert out["top1"] == pytest.approx(top) and 0 < top < 1
    assert out["tokens"] == 40


def test_identical_models_have_no_loss_and_bad_shapes_are_refused():
    ref = np.random.default_rng(1).normal(size=(8, 10))
    tally = QualityTally()
    tally.add(ref, ref.copy(), np.arange(8))
    out = tally.figures()
    assert out["delta_ppl"] == 0 and out["kl_max"] < 1e-12 and out["top1"] == 1.0
    with pytest.raises(ValueError, match="do not line up"):
        tally.add(ref, ref[:4], np.arange(8))
    with pytest.raises(ValueError, match="no positions"):
        QualityTally().figures()
