"""A dimension the model's own code fixes (issue 47): torch.export's range conflict becomes one
line naming the input, the dim, its axis, the size and the model's line, with the flag to add;
``--static-axes`` then exports the graph at the example's size, with parity, the manifest
recording the fixed axes."""

import json

import pytest
import torch

import tfgraph
from tfgraph.cli import main
from tfgraph.errors import TfgraphError
from tfgraph.sources import axis_conflicts, load_source
from tfgraph.sources.static_axes import parse_static_axes, with_static_axes


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    return lines[0]


def test_conflict_through_the_cli(tmp_path, capsys):
    """A causal mask filled in a Python loop over the length: one line, exit 2, nothing
    written."""
    out = tmp_path / "out"
    assert main(["export", "third_party_models:loop_mask_lm", "-o", str(out)]) == 2
    line = _one_line_error(capsys)
    assert "input 'x' dim 1 (axis 'sequence') to 9" in line, line
    assert "third_party_models.py:" in line, line  # the model's line that fixed it
    assert "for i in range(x.shape[1])" in line, line
    assert "--static-axes sequence" in line, line
    assert list(tmp_path.iterdir()) == []  # no artifact, no staging directory


# slow: a failing trace, then a full export with parity (about 20 s on a loaded 2-core
# machine); the error line alone is checked in the default tier above
@pytest.mark.slow
def test_static_axes_export_after_the_conflict(tmp_path, capsys):
    """The rel-pos model: the conflict names the helper's caller; ``--static-axes sequence``
    then exports it at the factory's example length, parity at that length, the manifest
    recording it."""
    out = tmp_path / "out"
    assert main(["export", "third_party_models:relpos_lm", "-o", str(out)]) == 2
    line = _one_line_error(capsys)
    assert "input 'x' dim 1 (axis 'sequence') to 9" in line, line
    assert "int(x.shape[1])" in line and "--static-axes sequence" in line, line
    assert not out.exists()

    assert main(["export", "third_party_models:relpos_lm", "-o", str(out),
                 "--static-axes", "sequence"]) == 0  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["static_axes"] == {"sequence": 12}  # the factory's example length
    assert manifest["inputs"][0]["shape"] == ["batch", 12]
    report = json.loads((out / "report.json").read_text())
    assert report["parity"]["passed"]
    assert {tuple(s) for s in report["parity"]["shapes"]} == {(1, 12), (2, 12)}  # as run
    capsys.readouterr()
    assert main(["parity", str(out)]) == 0  # the re-check fixes the same axis
    assert "pass" in capsys.readouterr().out


def _conflict(*lines: str) -> TfgraphError:
    """torch.export's range conflict as the trace wraps it (its first line only)."""
    header = f"{axis_conflicts.HEADER} and inferred ranges from model tracing:"
    error = TfgraphError(f"tracing x failed: ValueError: {header}")
    error.__cause__ = ValueError("\n".join([header, *lines]))
    return error


def test_conflict_lines_read_without_tracing():
    """torch's lines for a keyword input under ``**kwargs`` and a 0/1 specialization; one it
    cannot map to an input keeps torch's own line rather than the header alone."""
    source = load_source("third_party_models:keyword_mask_lm")
    error = _conflict(
        "- Received user-specified dim hint Dim.DYNAMIC(min=None, max=None), but tracing "
        "inferred a static shape of 9 for dimension inputs['kwargs']['mask'].shape[1].",
        "- Received user-specified dim hint Dim.DYNAMIC(min=None, max=None), but export 0/1 "
        "specialized due to hint of 1 for dimension inputs['x'].shape[0].",
    )
    assert axis_conflicts.is_conflict(error)
    message = str(axis_conflicts.explained(source, error, lambda: None))
    assert "input 'mask' dim 1 (axis 'sequence') to 9, input 'x' dim 0 (axis 'batch')" in message
    assert "--static-axes sequence,batch" in message, message
    unnamed = _conflict("- Received … a static shape of 3 for dimension inputs['z'].shape[2].")
    message = str(axis_conflicts.explained(source, unnamed, lambda: None))
    assert "inputs['z'].shape[2]" in message, message


def test_unknown_axis_lists_the_model_axes(tmp_path):
    with pytest.raises(TfgraphError, match=r"'seq' is not a dynamic axis .*: batch, sequence$"):
        tfgraph.export("third_party_models:relpos_lm", tmp_path / "out", static_axes="seq")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("bad", ["sequence=0", "=3", "batch,", "sequence=x"])
def test_malformed_flag(bad):
    with pytest.raises(TfgraphError, match="AXIS or AXIS=SIZE"):
        parse_static_axes(bad)


def test_fixed_source():
    """What another stage calls to fall back to a fixed batch: the axis leaves the dynamic
    axes, inputs are made at its size whatever is asked, the size is recorded."""
    source = load_source("third_party_models:relpos_lm")
    fixed = with_static_axes(source, ["batch=1"])
    assert fixed.dynamic_axes == {"x": {1: "sequence"}}
    assert fixed.inputs(4, 5)["x"].shape == (1, 5)
    assert fixed.info["static_axes"] == {"batch": 1}
    assert "static_axes" not in source.info  # the source given is left as it was
    both = with_static_axes(source, "batch,sequence")
    assert both.inputs(4, 5)["x"].shape == (2, 12) and both.dynamic_axes == {"x": {}}
    assert with_static_axes(source, ()) is source


def test_static_sequence_with_kv_cache_refused():
    source = load_source("third_party_models:relpos_lm")
    with pytest.raises(TfgraphError, match="--kv-cache"):
        with_static_axes(source, "sequence", kv_cache=True)
    assert with_static_axes(source, "batch", kv_cache=True).inputs(3, 4)["x"].shape[0] == 2


def test_parity_recheck_uses_the_static_sizes(tmp_path):
    """``tfgraph parity`` re-loads the source and fixes the same axes before checking."""
    source = load_source("third_party_models:relpos_lm")
    fixed = with_static_axes(source, "sequence")
    assert with_static_axes(source, fixed.info["static_axes_flag"]).inputs(3, 4)[
        "x"
    ].shape == torch.Size([3, 12])
