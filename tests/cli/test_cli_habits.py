"""What users bring from other tools: optimum-cli's spellings, typos answered with the closest
flag and the subcommand's own usage, a Hugging Face hub id, and ONNX Runtime's quantizer kept
quiet."""

import json
import warnings

import pytest
import torch

import tfgraph
from tfgraph.cli import build_parser, main
from tfgraph.errors import TfgraphError
from tfgraph.options import ExportOptions


@pytest.fixture
def exported(monkeypatch):
    """The (model, output, options) the CLI hands to export(), which does not run."""
    calls = []

    def fake(model, out, options):
        calls.append((model, out, options))
        raise TfgraphError("stopped before exporting")

    monkeypatch.setattr("tfgraph.exporting.export", fake)

    def run(*argv):
        calls.clear()
        assert main(["export", *argv]) == 2  # the fake's one-line error
        (call,) = calls
        return call

    return run


def test_optimum_spellings(exported, tmp_path):
    out = tmp_path / "out"
    model, path, options = exported("-m", "gpt-tiny", str(out))  # -m MODEL, positional output
    assert (model, path) == ("gpt-tiny", out)
    assert exported("gpt-tiny", str(out))[:2] == ("gpt-tiny", out)
    assert exported("--model", "gpt-tiny", "-o", str(out))[:2] == ("gpt-tiny", out)
    assert options.precision == "fp32" and options.target == "ort" and not options.kv_cache
    options = exported("gpt-tiny", str(out), "--dtype", "fp16", "--device", "cuda")[2]
    assert options.precision == "fp16" and options.target == "ort-cuda"
    options = exported("-m", "gpt-tiny", str(out), "--task", "text-generation-with-past")[2]
    assert options.kv_cache
    options = exported("gpt-tiny", str(out), "--task", "text2text-generation-with-past")[2]
    assert options.kv_cache
    options = exported("gpt-tiny", str(out), "--task", "feature-extraction")[2]
    assert not options.kv_cache and ExportOptions().target == options.target


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["-m", "gpt-tiny", "a", "b"], "the model is given twice: -m gpt-tiny and a"),
        (["gpt-tiny"], "give the artifact directory once: -o DIR, or as the last positional"),
        (["gpt-tiny", "a", "-o", "b"], "two artifact directories: a and b"),
        (["-o", "a"], "the following arguments are required: model (or -m MODEL)"),
        (["gpt-tiny", "a", "--device", "cpu", "--target", "ort-cuda"], "--device cpu and "),
        (["gpt-tiny", "a", "--task", "summarize-everything"], "argument --task: invalid choice"),
    ],
)
def test_alias_conflicts_are_usage_errors(argv, needle, capsys):
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tfgraph export") and needle in err


def _typo(flag: str) -> str:
    """``flag`` with its last two letters but one swapped: --kv-cache → --kv-cahce."""
    return flag[:-3] + flag[-2] + flag[-3] + flag[-1]


def _commands():
    for name, parser in build_parser().commands.items():
        flags = [s for a in parser._actions for s in a.option_strings if s != "--help"]
        required = [a.dest for a in parser._actions if not a.option_strings and a.nargs is None]
        options = [a.option_strings[0] for a in parser._actions if a.option_strings and a.required]
        filled = ["x"] * len(required) + [v for o in options for v in (o, "x")]
        yield pytest.param(name, filled, max(flags, key=len), id=name)


@pytest.mark.parametrize(("command", "filled", "flag"), list(_commands()))
def test_a_typo_gets_the_closest_flag_and_the_commands_usage(command, filled, flag, capsys):
    assert main([command, *filled, _typo(flag)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: tfgraph {command} ")
    assert f"unrecognized arguments: {_typo(flag)} (did you mean {flag}?)" in err


def test_the_issues_typo(capsys):
    assert main(["export", "gpt-tiny", "-o", "out", "--kv-cahce"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("usage: tfgraph export")
    assert err[-1] == (
        "tfgraph export: error: unrecognized arguments: --kv-cahce (did you mean --kv-cache?)"
    )


def test_a_hub_id_says_how_to_download_it(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", "meta-llama/Llama-3.2-1B", "-o", str(out)]) == 2
    (line,) = [e for e in capsys.readouterr().err.splitlines() if e.startswith("error:")]
    assert "hf download meta-llama/Llama-3.2-1B --local-dir Llama-3.2-1B" in line
    assert "then export Llama-3.2-1B" in line and not out.exists()
    with pytest.raises(TfgraphError, match="hf download Qwen/Qwen2.5-0.5B --local-dir"):
        tfgraph.export("Qwen/Qwen2.5-0.5B", out)


@pytest.fixture
def padded_llama(tmp_path):
    """A 2-layer Llama whose embedding has a padding row (all zeros: a block of scale 0, which
    made ONNX Runtime's quantizer warn once per read of the table)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
    assert not model.model.embed_tokens.weight[0].any()
    model.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


def test_int4_export_is_quiet(padded_llama, tmp_path, capsys):
    out = tmp_path / "int4"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every copy, as a plain `python -m tfgraph` shows them
        argv = ["-m", str(padded_llama), str(out), "--weights", "int4", "--device", "cpu"]
        assert main(["export", *argv]) == 0
    runtime = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert runtime == []
    assert "RuntimeWarning" not in capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert any(q.get("op") == "Gather" for q in report["weights"]["quantized"])  # the table
