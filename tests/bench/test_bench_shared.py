"""What a quick bench run's sections share (``tfgraph.bench.shared``): one source per key, one
trace per source and opset, and an identical export answered by the earlier one; nothing at
all outside a quick scope."""

from __future__ import annotations

import pytest

import tfgraph
from tfgraph.bench import shared
from tfgraph.models import build

KEY = ("module", "gpt-tiny", ())


def _source():
    return tfgraph.from_module(build("gpt-tiny"), origin="preset:gpt-tiny")


def test_a_quick_scope_shares_sources_traces_and_identical_exports(tmp_path):
    with shared.scope(True):
        assert shared.stats() == {"exports": 0, "traces_reused": 0, "exports_reused": 0}
        assert not shared.warm()
        source = shared.source(KEY, _source)
        assert shared.source(KEY, lambda: pytest.fail("made twice")) is source
        unfused = shared.export(source, tmp_path / "unfused", pipeline="none", target="ort")
        fused = shared.export(source, tmp_path / "fused", pipeline="default", target="ort")
        assert unfused.passed and fused.passed
        assert shared.warm()
        assert shared.stats() == {"exports": 2, "traces_reused": 1, "exports_reused": 0}
        with shared.scope(True):  # nested: the same scope
            again = shared.export(source, tmp_path / "again")  # defaults: default, ort
        assert shared.stats()["exports_reused"] == 1
        assert again.report is fused.report and again.out_dir == tmp_path / "again"
        assert (tmp_path / "again").is_symlink()
        assert (tmp_path / "again").resolve() == (tmp_path / "fused").resolve()
        assert (tmp_path / "again" / "model.onnx").is_file()
    assert shared.stats() is None and not shared.warm()


# slow: 50 s of exports; the quick-scope sharing test stays
@pytest.mark.slow
def test_no_sharing_outside_a_quick_scope(tmp_path):
    with shared.scope(False):
        assert shared.stats() is None
        made = [shared.source(KEY, _source) for _ in range(2)]
        assert made[0] is not made[1]
        first = shared.export(made[0], tmp_path / "a")
        second = shared.export(made[0], tmp_path / "b")
    assert first.passed and second.passed
    assert not (tmp_path / "b").is_symlink()
    assert second.report["timings"]["trace"] > 0.5  # traced again (a reused trace: ~0.05 s)
