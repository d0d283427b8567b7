"""The differential fuzzer (``tfgraph.tools.fuzz``, ``python -m tfgraph fuzz``).

- a bounded campaign over the whole model space passes through the same code path as the CLI
  (every target, KV cache and greedy generation included);
- a deliberately broken lowering is caught, and the failure prints the config and the seed;
- Hypothesis shrinks a failure to a minimal config, and leaves no ``.hypothesis`` directory;
- the strategy reaches every family, position scheme, norm, FFN, attention implementation,
  mask style (added, selected, SDPA's is_causal), soft-capping and norm operand order.
"""

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed

import tfgraph.passes.lower.lower_attention as lower_attention
from tfgraph.cli import main
from tfgraph.models.config import (
    ATTN_IMPLS,
    FAMILIES,
    FFNS,
    MASK_STYLES,
    NORM_ORDERS,
    NORMS,
    POSITIONS,
    ModelConfig,
)
from tfgraph.models.presets import PRESETS
from tfgraph.tools.fuzz import ParityFailure, check_case, run_fuzz
from tfgraph.tools.fuzz_cases import (
    PADDINGS,
    PRECISIONS,
    FuzzCase,
    expected_candidates,
    fusion_problems,
    fuzz_cases,
)

# every target, KV cache and generation: a decoder, an encoder-decoder, two encoders (≈ 70 s)
CAMPAIGN_EXAMPLES, CAMPAIGN_SEED = 4, 1
TINY = FuzzCase(
    config=ModelConfig(vocab_size=64, d_model=16, n_layers=1, n_heads=2, max_seq_len=64),
    parity_shapes=((2, 9),),
)


@pytest.fixture
def broken_scale(monkeypatch):
    """Every lowered attention computes softmax(1.25·scale·QKᵀ): wrong numbers, valid graph."""
    canonical = lower_attention.AttentionOp

    class WrongScale:  # what LowerAttentionPass reads the canonical op with
        OP = canonical.OP

        @staticmethod
        def read(node, head_size=None):
            spec = canonical.read(node, head_size=head_size)
            return dataclasses.replace(spec, scale=spec.scale * 1.25)

    monkeypatch.setattr(lower_attention, "AttentionOp", WrongScale)


# slow: a fuzz campaign over the whole model space
@pytest.mark.slow
def test_campaign_passes(tmp_path):
    events = []
    report = run_fuzz(
        CAMPAIGN_EXAMPLES,
        seed=CAMPAIGN_SEED,
        keep_going=True,  # bounded time: no shrinking in CI (the CLI shrinks by default)
        workdir=tmp_path,
        progress=events.append,
    )
    assert report.passed, "\n\n".join(map(str, report.failures))
    families = {e.case.config.family for e in events if e.outcome == "ok"}
    assert families == {"decoder", "encoder", "encoder-decoder"}
    assert report.examples == CAMPAIGN_EXAMPLES and report.count("ok") == CAMPAIGN_EXAMPLES
    assert [e.label for e in events if e.outcome == "ok"] == [
        f"{i}/{CAMPAIGN_EXAMPLES}" for i in range(1, CAMPAIGN_EXAMPLES + 1)
    ]


def test_broken_lowering_fails_with_config_and_seed(broken_scale, tmp_path):
    with pytest.raises(ParityFailure) as info:
        check_case(TINY, tmp_path, targets=("onnx",), cache=False, reproduce="--seed 7")
    message = str(info.value)
    assert "[parity] export target=onnx" in message
    assert f"config: {dataclasses.asdict(TINY.config)}" in message
    assert "'weight_seed': 0" in message and "--seed 7" in message
    replay = json.loads(message.split("--replay '")[1].split("'")[0])
    assert FuzzCase.from_dict(replay) == TINY


# slow: a fuzz campaign against a broken lowering until it is found and shrunk
@pytest.mark.slow
def test_cli_reports_a_broken_lowering(broken_scale, capsys):
    argv = ["fuzz", "--examples", "3", "--seed", "2", "--targets", "ort", "--no-cache"]
    assert main([*argv, "--keep-going"]) == 1
    out, err = capsys.readouterr()
    assert "parity failures" in out and "FAILED" in out
    assert "[parity] export target=ort" in out and "config: {'family': " in out
    assert "python -m tfgraph fuzz --examples 3 --seed 2 --targets ort --no-cache" in out
    assert "--seed 2" in err and "[1/3]" in err


def test_shrinking_finds_a_minimal_config(tmp_path, monkeypatch):
    """A fake check that fails on every RoPE model: Hypothesis shrinks the rest away."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYPOTHESIS_STORAGE_DIRECTORY", raising=False)

    def check(case, workdir, **kwargs):
        if case.config.positions == "rope":
            raise ParityFailure(case, "fake", "RoPE is broken", kwargs["reproduce"])

    report = run_fuzz(60, seed=3, check=check)
    assert len(report.failures) == 1 and report.shrink_runs > 0
    failure = report.failures[0]
    cfg = failure.case.config
    assert (cfg.positions, cfg.family, cfg.n_layers, cfg.n_heads) == ("rope", "decoder", 1, 1)
    assert cfg.sliding_window is None and cfg.rope_fraction == 1.0 and cfg.norm == "layernorm"
    assert "python -m tfgraph fuzz --examples 60 --seed 3" in str(failure)
    notes = "\n".join(failure.__notes__)
    assert "case=FuzzCase(config=ModelConfig(" in notes and "@reproduce_failure(" in notes
    assert report.count("parity") == 1  # shrink runs are not counted as examples
    assert not (tmp_path / ".hypothesis").exists()


# slow: 10 s; the fuzz command's path through the CLI stays in test_cli_replays_a_case and its
# examples' checks in test_new_forms_pass_every_check
@pytest.mark.slow
def test_cli_fuzz_one_example(capsys):
    assert main(["fuzz", "--examples", "1", "--seed", "0"]) == 0
    out, err = capsys.readouterr()
    assert "examples" in out and "incomplete fusions" in out and "seed 0: passed" in out
    assert "[1/1] " in err and "[1/1] ok" in err


def test_cli_replays_a_case(capsys):
    argv = ["fuzz", "--replay", json.dumps(TINY.as_dict()), "--targets", "ort", "--no-cache"]
    assert main(argv) == 0
    assert "passed" in capsys.readouterr().out


def test_cli_refuses_unknown_targets(capsys):
    assert main(["fuzz", "--targets", "ort,tpu"]) == 2
    assert "--targets" in capsys.readouterr().err
    assert main(["fuzz", "--profiles", "ort"]) == 2  # the old name is no option any more
    assert "unrecognized arguments: --profiles" in capsys.readouterr().err


def test_replay_reads_the_old_cache_key():
    """Replay JSON printed before the rename stored ``cache_profile``; it still reads."""
    old = TINY.as_dict()
    old["cache_profile"] = "tensorrt"
    del old["cache_target"]
    assert FuzzCase.from_dict(old) == dataclasses.replace(TINY, cache_target="tensorrt")
    assert "cache_profile" not in TINY.as_dict()


@pytest.mark.parametrize("name", ["gpt-tiny", "t5-tiny", "palm-tiny", "seed-layernorm-tiny"])
def test_expected_candidates_match_the_presets(name):
    """The counts the fuzzer expects, on presets whose counts the zoo tests pin down."""
    cfg = PRESETS[name]
    want = {
        "gpt-tiny": {"attention": 2, "norm": 5, "gelu": 2},
        "t5-tiny": {"attention": 6, "norm": 12, "gelu": 0},
        "palm-tiny": {"attention": 2, "norm": 3, "gelu": 0},
        "seed-layernorm-tiny": {"attention": 2, "norm": 5, "gelu": 2},
    }[name]
    assert expected_candidates(cfg) == want


def test_strategy_covers_the_model_space():
    seen: dict[str, set] = {k: set() for k in ("family", "positions", "norm", "ffn", "impl")}
    seen.update({k: set() for k in ("placement", "heads", "head_dim", "window", "padding")})
    seen.update({k: set() for k in ("mask_style", "softcap", "norm_order", "precision")})

    @settings(max_examples=400, database=None, suppress_health_check=list(HealthCheck))
    @hypothesis_seed(0)
    @given(fuzz_cases())
    def draw(case):
        cfg = case.config
        assert cfg.d_model <= 64 and cfg.vocab_size <= 128 and 1 <= cfg.n_layers <= 2
        seen["family"].add(cfg.family)
        seen["positions"].add(cfg.positions)
        seen["norm"].add(cfg.norm)
        seen["ffn"].add(cfg.ffn)
        seen["impl"].add(cfg.attn_impl)
        seen["placement"].add("parallel" if cfg.parallel_block else cfg.norm_placement)
        kind = "MHA" if cfg.kv_heads == cfg.n_heads else "MQA" if cfg.kv_heads == 1 else "GQA"
        seen["heads"].add(kind)
        seen["head_dim"].add(cfg.head_dim % 8 == 0)
        seen["window"].add(cfg.sliding_window is not None)
        seen["padding"].add(case.padding)
        seen["mask_style"].add(cfg.mask_style)
        seen["softcap"].add(cfg.softcap is not None)
        seen["norm_order"].add(cfg.norm_order)
        seen["precision"].add(case.precision)
        if cfg.positions == "rope":
            seen["positions"].add("rope-partial" if cfg.rotary_dim < cfg.head_dim else "rope")
            seen["positions"].add("rope-ntk" if cfg.rope_ntk_factor != 1.0 else "rope")

    draw()
    assert seen["family"] == set(FAMILIES) and seen["norm"] == set(NORMS)
    assert seen["positions"] == {*POSITIONS, "rope-partial", "rope-ntk"}
    assert seen["ffn"] == set(FFNS) and seen["impl"] == set(ATTN_IMPLS)
    assert seen["placement"] == {"pre", "post", "parallel"}
    assert seen["heads"] == {"MHA", "GQA", "MQA"} and seen["head_dim"] == {True, False}
    assert seen["window"] == {True, False} and seen["padding"] == set(PADDINGS)
    # the idioms of issue 14: is_causal, selection masks, soft-capping, norm operand orders
    assert seen["mask_style"] == set(MASK_STYLES) and seen["softcap"] == {True, False}
    assert seen["norm_order"] == set(NORM_ORDERS)
    assert seen["precision"] == set(PRECISIONS)  # issue 16: fp16 exports are fuzzed too


def test_new_forms_pass_every_check(tmp_path):
    """One case with the issue-14 forms at once: a selection mask over ALiBi, soft-capped
    scores, a sliding window and a hand-ordered RMSNorm, on every target and cached."""
    cfg = ModelConfig(
        d_model=32,
        n_heads=4,
        n_layers=2,
        vocab_size=64,
        max_seq_len=64,
        positions="alibi",
        mask_style="select-where",
        softcap=20.0,
        sliding_window=4,
        norm="rmsnorm",
        norm_order="w*x*r",
    )
    timings = check_case(FuzzCase(config=cfg, padding="left"), tmp_path)
    assert timings  # every stage ran (a failure raises)


def test_is_causal_under_a_position_table_caches(tmp_path):
    """Finding of the 1000-case campaign (seeds 41/42): SDPA's is_causal mask read Q's shape
    through a learned position table of 128 rows, so the long mask check (4100 positions)
    could not run, the mask was kept as a bias and the KV cache refused the layer as not
    causal. The check now halves its length until the graph runs."""
    cfg = ModelConfig(
        family="decoder",
        n_layers=2,
        d_model=15,
        n_heads=3,
        d_ff=60,
        positions="learned",
        norm_placement="post",
        ffn="relu",
        attn_impl="sdpa",
        mask_style="is-causal",
        norm_order="x*w/s",
    )
    case = FuzzCase(config=cfg, weight_seed=2, input_seed=856, parity_shapes=((1, 2),))
    timings = check_case(case, tmp_path, targets=("ort",))
    assert "generate target=ort" in timings  # cached, and generation equal to eager


def test_softcap_misses_count_only_when_stated():
    cfg = ModelConfig(d_model=32, n_heads=4, n_layers=2, softcap=20.0)
    want = expected_candidates(cfg)
    stated = {"reason": "soft-capped scores put a tanh between the MatMuls, …"}
    fusions = {
        "attention": {"fused": 1, "total": 2, "missed": [stated]},
        "norm": {"fused": want["norm"], "total": want["norm"], "missed": []},
    }
    assert fusion_problems(cfg, fusions) == []
    fusions["attention"]["missed"] = [{"reason": "expected Add, got Where"}]
    assert fusion_problems(cfg, fusions)  # any other miss is a problem
    uncapped = ModelConfig(d_model=32, n_heads=4, n_layers=2)
    fusions["attention"]["missed"] = [stated]
    assert fusion_problems(uncapped, fusions)  # and a softcap miss without a softcap too
