"""Ctrl-C, SIGTERM and SIGHUP during an export leave nothing behind; what a killed export left
(a stale staging directory) is removed by the next export into the same directory.

Each interrupted export runs in a driver process (``_drive``) that calls the CLI's ``main``
once per case, the signal raised as the case's stage starts (or sent from here while that stage
runs); a case reports the exit code and what is left in the output's parent. One process per
model: its trace is cached across the cases, so that a case costs the stages before its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

import tfgraph
import tfgraph.exporting as exporting
from tfgraph import interrupts
from tfgraph.exporters.artifact import _host, sweep_stale
from tfgraph.passes.pipeline.run import CHECK_EACH_PASS_ENV

TESTS = Path(__file__).resolve().parents[1]  # tests/: the factories' module is found there
ROOT = TESTS.parent  # where this module is imported from, as the package tests.…
BOTH = (signal.SIGINT, signal.SIGTERM)

# export configuration → the stages whose start is interrupted in it; together every stage.
# The configurations of one model run in one process, sharing its trace.
REFERENCE = Path(__file__).resolve().parents[2] / "bench" / "reference_model"

CONFIGS = {
    "tiny-int4": (
        "factories:tiny_lm --weights int4".split(),
        ["load", "trace", "passes", "weights", "save", "parity", "quantization error"],
    ),
    # an int8 cache has a scratch directory beside the staging one from "kv cache" on
    "gpt-kv-int8": ("gpt-tiny --kv-cache --kv-dtype int8".split(), ["kv cache", "parity"]),
    "gpt-paged-fp16": (
        "gpt-tiny --kv-cache --target ort-cuda --precision fp16 --kv-layout paged".split(),
        ["precision", "paging"],
    ),
    # a flavour's step after the last precision step (a transformers model from a factory:
    # the optimum flavour refuses a model without a Hugging Face config before the trace)
    "hf-flavour": ("factories:tiny_hf_llama --kv-cache --flavour optimum".split(), ["flavour"]),
    # the quality stage measures the staged artifact: a model with a tokenizer (the reference)
    "hf-quality": (
        [str(REFERENCE), "--quality-text", str(REFERENCE / "heldout.txt")],
        ["quality"],
    ),
}


# ---- the driver (runs in the child process) ----


def _drive(spec_path: str) -> None:
    """Run each case of the spec through ``tfgraph.cli.main``; one JSON line per case on
    stdout, a ``=== i`` line on stderr before each."""
    from tfgraph.cli import main

    cases = json.loads(Path(spec_path).read_text())
    _default_handlers()  # as in a terminal, whatever the test runner's were
    before = [signal.getsignal(s) for s in interrupts.SIGNALS]
    _cache_traces()
    case: dict = {}
    real_timed = exporting.Stages.timed

    @contextlib.contextmanager
    def timed(self, name):
        with real_timed(self, name):
            if name == case["stage"]:
                case["reached"] = True
                _interrupt(case)
            yield

    exporting.Stages.timed = timed
    for i, spec in enumerate(cases):
        case.clear()
        case.update(spec, reached=False)
        parent = Path(spec["parent"])
        parent.mkdir(parents=True)
        print(f"=== {i}", file=sys.stderr, flush=True)
        try:
            rc = main([*spec["argv"], "-o", str(parent / "sub" / "art")])
        except BaseException:  # what would have reached the user as a traceback
            traceback.print_exc()
            rc = None
        result = {
            "rc": rc,
            "reached": case["reached"],
            "present": case.get("present"),  # beside the output as the signal came
            "left": sorted(os.listdir(parent)),
            "restored": [signal.getsignal(s) for s in interrupts.SIGNALS] == before,
        }
        print(json.dumps(result), flush=True)


def _default_handlers() -> dict:
    """Python's own handlers (a test runner started in the background ignores SIGINT); the
    ones replaced, to restore."""
    return {
        s: signal.signal(s, signal.default_int_handler if s == signal.SIGINT else signal.SIG_DFL)
        for s in interrupts.SIGNALS
    }


def _interrupt(case: dict) -> None:
    """The signal, as the stage starts: what is beside the output is recorded first."""
    sub = Path(case["parent"]) / "sub"
    case["present"] = sorted(os.listdir(sub)) if sub.is_dir() else []
    if case["how"] == "raise":
        signal.raise_signal(case["signum"])  # the handler runs before this returns
    else:
        time.sleep(120)  # until the test sends the signal


def _cache_traces() -> None:
    """One trace per model and opset for the cases of the process (the trace depends on
    nothing else of the options: ``TraceCache``)."""
    from tfgraph.sources.trace import TraceCache

    cache = TraceCache(by_origin=True)
    real = exporting.trace_source

    def traced(model, source, options, trace_cache=None):
        return real(model, source, options, cache)

    exporting.trace_source = traced


# ---- the test side ----


def _run_cases(tmp_path: Path, cases: list[dict]) -> list[tuple[dict, str]]:
    """(result, stderr) per case."""
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    env = {k: v for k, v in os.environ.items() if k != CHECK_EACH_PASS_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS), env.get("PYTHONPATH", "")])
    code = f"import {__name__} as t; t._drive({str(spec)!r})"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        errs = _read_stderr(child, cases)
        out = child.stdout.read()
        assert child.wait(timeout=300) == 0, "".join(errs)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), "".join(errs)
    return list(zip(results, errs[1:], strict=True))


def _read_stderr(child: subprocess.Popen, cases: list[dict]) -> list[str]:
    """The child's stderr split at its ``=== i`` lines; a case sent from outside gets its
    signal when its stage's progress line appears."""
    parts = [""]
    deadline = time.monotonic() + 300
    for line in child.stderr:
        assert time.monotonic() < deadline, "".join(parts)
        if re.match(r"=== \d+$", line.strip()):
            parts.append("")
            continue
        parts[-1] += line
        case = cases[len(parts) - 2] if len(parts) > 1 else None
        if case and case["how"] == "send" and re.match(rf"\[\d+/\d+\] {case['stage']} …", line):
            time.sleep(0.2)  # into the stage's sleep
            child.send_signal(case["signum"])
    return parts


def _cases(tmp_path: Path, config: str, stages, signums, how="raise") -> list[dict]:
    return [
        {
            "argv": ["export", *CONFIGS[config][0]],
            "stage": stage,
            "signum": int(signum),
            "how": how,
            "parent": str(
                tmp_path / f"{config}-{how}-{stage.replace(' ', '-')}-{signal.Signals(signum).name}"
            ),
        }
        for stage in stages
        for signum in signums
    ]


def _check(results: list[tuple[dict, str]], cases: list[dict]) -> None:
    for (result, err), case in zip(results, cases, strict=True):
        name = signal.Signals(case["signum"]).name
        where = f"{name} at {case['stage']!r}:\n{err}"
        assert result["reached"], f"the export never reached {case['stage']!r}: {where}"
        assert result["rc"] == 128 + case["signum"], where
        assert "Traceback" not in err, where
        assert err.rstrip().splitlines()[-1] == f"interrupted ({name})", where
        assert result["left"] == [], f"left behind: {result['left']}; {where}"
        present = " ".join(result["present"])
        if case["stage"] not in ("load", "trace"):  # staged from the passes on
            assert ".art.tfgraph-" in present, where
        if "int8" in case["argv"] and case["stage"] in ("kv cache", "save", "parity"):
            assert ".tfgraph-kv-" in present, where
        assert result["restored"], f"signal handlers not restored after {where}"


@pytest.mark.parametrize(
    "model",
    # slow: gpt goes through the same preset stages as tiny, a bigger graph (~35 s)
    ["tiny", pytest.param("gpt", marks=pytest.mark.slow), "hf"],
)
def test_an_interrupt_at_each_stage_leaves_nothing(tmp_path, model):
    """SIGINT and SIGTERM at the start of each stage; for the tiny model also SIGTERM, SIGHUP
    and SIGINT sent from outside (as ``kill`` or a closed terminal sends them) while a stage is
    blocked in a system call with the staging directory in place. One process per model."""
    cases = [
        case
        for config, (_, stages) in CONFIGS.items()
        if config.startswith(model)
        for case in _cases(tmp_path, config, stages, BOTH)
    ]
    if model == "tiny":
        sent = [signal.SIGTERM, signal.SIGHUP]
        cases += _cases(tmp_path, "tiny-int4", ["parity"], sent, how="send")
        cases += _cases(tmp_path, "tiny-int4", ["save"], [signal.SIGINT], how="send")
    _check(_run_cases(tmp_path, cases), cases)


def test_every_stage_is_interrupted_by_some_case():
    """A stage added to ``export`` is added to CONFIGS too."""
    source = Path(exporting.__file__).read_text()
    stages = set(re.findall(r'stages\.timed\(\s*"([^"]+)"', source))
    covered = {stage for _, names in CONFIGS.values() for stage in names}
    assert stages and stages <= covered, stages - covered


# ---- stale directories ----


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", ""])
    child.wait()
    return child.pid


@pytest.fixture
def live_pid():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield child.pid
    child.kill()
    child.wait()


def _staging(parent: Path, name: str) -> Path:
    path = parent / name
    path.mkdir()
    (path / "model.onnx.data").write_bytes(b"\0" * 1024)
    return path


def test_the_next_export_removes_stale_staging_and_keeps_live_ones(
    tmp_path, live_pid, monkeypatch, caplog
):
    host, dead = _host(), _dead_pid()
    stale = [
        _staging(tmp_path, f".art.tfgraph-{host}-{dead}-abcd_123"),
        _staging(tmp_path, f".other.tfgraph-{host}-{dead}-zzzzzzzz"),
        _staging(tmp_path, f".tfgraph-kv-{host}-{dead}-k0k0k0k0"),
        _staging(tmp_path, f".art.tfgraph-old-{host}-{dead}"),  # art is there: removed
    ]
    kept = [
        _staging(tmp_path, f".art.tfgraph-{host}-{live_pid}-abcdefgh"),  # still running
        _staging(tmp_path, f".art.tfgraph-00000000-{dead}-abcdefgh"),  # another host's
        _staging(tmp_path, f".tfgraph-kv-{host}-{dead}"),  # not a name tfgraph makes
        _staging(tmp_path, ".art.tfgraph-x1y2z3w4"),  # an earlier version's: reported
    ]
    (tmp_path / f".notes.tfgraph-{host}-{dead}-abcdefgh").write_text("a file, not ours")
    (tmp_path / "art").mkdir()
    (tmp_path / "art" / "manifest.json").write_text("{}")
    staged = []
    real = exporting.write_artifact

    def write_artifact(graph, stage, *args):
        staged.append(stage.name)
        return real(graph, stage, *args)

    monkeypatch.setattr(exporting, "write_artifact", write_artifact)
    with caplog.at_level(logging.WARNING, logger="tfgraph.exporters.artifact"):
        tfgraph.export("factories:tiny_lm", tmp_path / "art")
    assert re.fullmatch(rf"\.art\.tfgraph-{host}-{os.getpid()}-[a-z0-9_]{{8}}", staged[0])
    assert not any(p.exists() for p in stale)
    assert all(p.is_dir() for p in kept)
    assert (tmp_path / f".notes.tfgraph-{host}-{dead}-abcdefgh").is_file()
    assert (tmp_path / "art" / "model.onnx").is_file()
    removed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("removed")]
    assert len(removed) == len(stale), removed
    assert any(".art.tfgraph-x1y2z3w4 was left by an earlier" in r.message for r in caplog.records)


def test_an_artifact_moved_aside_by_a_killed_export_is_restored(tmp_path):
    """Killed between its two renames, an export leaves the artifact it was replacing under a
    hidden name and none under its own: the sweep puts it back."""
    old = _staging(tmp_path, f".art.tfgraph-old-{_host()}-{_dead_pid()}")
    (old / "manifest.json").write_text("{}")
    assert sweep_stale(tmp_path) == [old]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    assert (tmp_path / "art" / "manifest.json").is_file()


def test_a_symlink_is_never_followed(tmp_path):
    target = _staging(tmp_path, "precious")
    link = tmp_path / f".art.tfgraph-{_host()}-{_dead_pid()}-abcdefgh"
    link.symlink_to(target)
    assert sweep_stale(tmp_path) == []
    assert link.is_symlink() and (target / "model.onnx.data").is_file()


# ---- the handlers ----


@pytest.fixture
def default_handlers():
    replaced = _default_handlers()
    yield
    for signum, handler in replaced.items():
        if handler is not None:  # None: set outside Python, cannot be put back
            signal.signal(signum, handler)


def _installed(signum: int) -> bool:
    return signal.getsignal(signum) is interrupts._handler


@pytest.mark.usefixtures("default_handlers")
def test_sigterm_raises_interrupted_and_the_handlers_are_restored():
    before = [signal.getsignal(s) for s in interrupts.SIGNALS]
    with pytest.raises(interrupts.Interrupted) as caught, interrupts.unwinding():
        assert _installed(signal.SIGTERM)  # else the signal would end the test process
        with interrupts.unwinding():  # nested: no change
            signal.raise_signal(signal.SIGTERM)
    assert caught.value.signum == signal.SIGTERM and caught.value.exit_code == 143
    assert isinstance(caught.value, KeyboardInterrupt)
    assert [signal.getsignal(s) for s in interrupts.SIGNALS] == before


@pytest.mark.usefixtures("default_handlers")
def test_a_deferred_signal_is_raised_when_the_block_ends():
    done = []
    with pytest.raises(interrupts.Interrupted), interrupts.unwinding():
        assert _installed(signal.SIGINT)
        with interrupts.deferred():
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # pressed twice: still one
            done.append("the block ran to its end")
    assert done


@pytest.mark.usefixtures("default_handlers")
def test_a_signal_handled_elsewhere_is_left_alone():
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    try:
        with interrupts.unwinding():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            signal.raise_signal(signal.SIGHUP)  # ignored
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
