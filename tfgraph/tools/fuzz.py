"""Differential fuzzing: random zoo models through every target, against eager PyTorch.

A Hypothesis strategy (:func:`~tfgraph.tools.fuzz_cases.fuzz_cases`, with the rest of the
case space in :mod:`tfgraph.tools.fuzz_cases`) draws a :class:`FuzzCase`: a valid
:class:`~tfgraph.models.config.ModelConfig` from the whole space the zoo supports (family,
query/KV heads, head size, width, layers, positions, norm kind and placement, FFN, attention
implementation, sliding window, …; tiny: d_model ≤ 64, vocab ≤ 128) plus the inputs (parity
shapes, padding, weight and input seeds, generation prompts). :func:`check_case` builds the
module and, per target, exports it (``tfgraph.export``) and checks

- parity against eager PyTorch passed;
- for every fusion kind, ``fused == total`` and ``total`` is the number of candidates the
  config has (the seed's ``(σ+ε)`` norm is never folded: it must be reported ``excluded``);
- decoders and encoder-decoders: the KV-cached export (``ort`` and one other target) passes
  its prefill and decode parity, and greedy generation (batch 2, prompts of different lengths)
  equals eager full recompute token for token.

A failed check raises a :class:`FuzzFailure` (an ``AssertionError``, so Hypothesis shrinks it)
whose message holds the config as a dict, the seeds, the campaign command and a ``--replay``
command that checks that one case again.

:func:`run_fuzz` runs a campaign (``python -m tfgraph fuzz`` is its command line): the same
seed draws the same cases; no example database and no ``.hypothesis`` directory. By default it
stops at the first failure and shrinks it to a minimal config; ``keep_going`` runs every
example and lists every failure, unshrunk. Hypothesis follows each new example with a few
mutations of it (one or two fields changed); at ~20 s an example the campaign skips those
near-duplicates (:meth:`_Recorder.novel`), except while shrinking.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import seed as hypothesis_seed

from tfgraph.exporters.targets import get_target
from tfgraph.sources import ModelSource
from tfgraph.sources.trace import TraceCache
from tfgraph.tools.fuzz_cases import TARGETS, FuzzCase, case_source, fusion_problems, fuzz_cases
from tfgraph.verify.generation_parity import compare_greedy, encoder_inputs

logger = logging.getLogger(__name__)

NEAR_DUPLICATE = 3  # fields: a case this close to one already run (same family) is skipped


# --- failures ---------------------------------------------------------------------------------


class FuzzFailure(AssertionError):
    """A check failed on a case; the message reproduces it. ``kind``: parity, fusion, crash."""

    kind = "failure"

    def __init__(self, case: FuzzCase, stage: str, detail: str, reproduce: str = "") -> None:
        self.case, self.stage, self.detail = case, stage, detail
        lines = [
            f"[{self.kind}] {stage}: {detail}",
            f"case: {case.summary()}",
            f"config: {dataclasses.asdict(case.config)}",
            "inputs: " + str({k: v for k, v in case.as_dict().items() if k != "config"}),
        ]
        if reproduce:
            lines.append(f"reproduce: {reproduce}")
        lines.append(f"replay this case alone: {replay_command(case)}")
        super().__init__("\n".join(lines))


class ParityFailure(FuzzFailure):
    kind = "parity"


class FusionIncomplete(FuzzFailure):
    kind = "fusion"


class Crash(FuzzFailure):
    kind = "crash"


def replay_command(case: FuzzCase) -> str:
    import json

    return f"python -m tfgraph fuzz --replay '{json.dumps(case.as_dict())}'"


# --- checks -----------------------------------------------------------------------------------


def _parity_detail(parity: dict) -> str:
    worst = [o for o in parity["outputs"] if not o["passed"]] or parity["outputs"]
    rows = [
        f"{o['name']} max_abs_err={o['max_abs_err']:.3g} max_rel_err={o['max_rel_err']:.3g}"
        for o in worst
    ]
    failed = [c for c in parity["cases"] if not c["passed"]][:3]
    where = [
        {k: c[k] for k in ("phase", "batch", "sequence", "past", "new", "error") if k in c}
        for c in failed
    ]
    return "; ".join(rows) + (f"; failing cases {where}" if where else "")


@dataclass
class CaseContext:
    """Where a case runs and how a failure says to reproduce it."""

    workdir: Path
    reproduce: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    traces: TraceCache = field(default_factory=TraceCache)  # one trace per opset, not per export

    @contextmanager
    def stage(self, case: FuzzCase, name: str) -> Iterator[None]:
        """Time a stage; an unexpected exception in it becomes a :class:`Crash`."""
        start = time.perf_counter()
        try:
            yield
        except FuzzFailure:
            raise
        except Exception as exc:
            raise Crash(case, name, describe_exception(exc), self.reproduce) from exc
        finally:
            self.timings[name] = round(time.perf_counter() - start, 2)
            logger.info("fuzz %s: %.2f s", name, self.timings[name])


def describe_exception(exc: BaseException) -> str:
    """``Type: message (at file:line in function)``, the innermost frame that raised it."""
    text = traceback.format_exception_only(type(exc), exc)[-1].strip()[:2000]
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        where = frames[-1]
        text += f" (at {Path(where.filename).name}:{where.lineno} in {where.name})"
    return text


def _export(
    source: ModelSource, case: FuzzCase, ctx: CaseContext, out: Path, target: str, kv_cache: bool
):
    from tfgraph.exporting import export

    return export(
        source,
        out,
        target=target,
        kv_cache=kv_cache,
        parity_shapes=case.parity_shapes,
        trace_cache=ctx.traces,
        precision=case.precision,
    )


def _check_report(case: FuzzCase, ctx: CaseContext, stage: str, report: dict) -> None:
    if not report["parity"]["passed"]:
        raise ParityFailure(case, stage, _parity_detail(report["parity"]), ctx.reproduce)
    problems = fusion_problems(case.config, report["fusions"])
    if problems:
        raise FusionIncomplete(case, stage, " | ".join(problems), ctx.reproduce)


def check_export(source: ModelSource, case: FuzzCase, ctx: CaseContext, target: str) -> None:
    """Uncached export at ``target``: parity and complete fusions."""
    stage = f"export target={target}"
    with ctx.stage(case, stage):
        result = _export(source, case, ctx, ctx.workdir / target, target, kv_cache=False)
    _check_report(case, ctx, stage, result.report)


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Silence a logger's warnings for a while (its errors still show)."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def check_cached(source: ModelSource, case: FuzzCase, ctx: CaseContext, target: str) -> None:
    """KV-cached export at ``target``: cache parity, fusions, greedy generation vs eager."""
    from tfgraph.runtime import CachedDecoder, Session

    stage = f"export --kv-cache target={target}"
    out = ctx.workdir / f"{target}-kv"
    with ctx.stage(case, stage):
        result = _export(source, case, ctx, out, target, kv_cache=True)
    _check_report(case, ctx, stage, result.report)
    if case.precision != "fp32":  # its cache parity used the precision's rule; fp16 logits
        return  # of a random model tie often, so tokens against fp32 eager say little
    stage = f"generate target={target}"
    with ctx.stage(case, stage):
        decoder = CachedDecoder(Session(out))
        prompts, extra = case.prompts(), {}
        if decoder.seq2seq:  # prompts feed the encoder
            prompts, extra = [[0]] * len(prompts), encoder_inputs(decoder, prompts)
        with _quiet("tfgraph.runtime.generate"):  # unequal prompts without a mask: intended
            comparison = compare_greedy(source, decoder, prompts, case.new_tokens, extra=extra)
    if not comparison.agrees_up_to_a_tie():
        bad = next(i for i, r in enumerate(comparison.steps) if not r["passed"])
        row = comparison.steps[bad]
        detail = (
            f"step {bad}: logits max_abs_err={row['max_abs_err']:.3g}; cached tokens "
            f"{comparison.tokens} != eager {comparison.want_tokens}"
        )
        raise ParityFailure(case, stage, detail, ctx.reproduce)
    if not comparison.passed:
        logger.info("generation diverged at a near tie (step %s)", comparison.divergence())


def cache_targets(case: FuzzCase, targets: tuple[str, ...]) -> list[str]:
    """``ort`` and the case's other target, among those asked for (else the first asked)."""
    chosen = [t for t in ("ort", case.cache_target) if t in targets]
    return chosen or list(targets[:1])


def check_case(
    case: FuzzCase,
    workdir: str | Path | None = None,
    *,
    targets: tuple[str, ...] = TARGETS,
    cache: bool = True,
    reproduce: str = "",
) -> dict[str, float]:
    """Run every check on ``case``; raises :class:`FuzzFailure`. Returns stage timings."""
    with tempfile.TemporaryDirectory(prefix="tfgraph-fuzz-", dir=workdir) as tmp:
        ctx = CaseContext(Path(tmp), reproduce)
        with ctx.stage(case, "build"):
            source = case_source(case)
        for target in targets:
            check_export(source, case, ctx, target)
        if cache and case.config.family != "encoder":
            for target in cache_targets(case, targets):
                check_cached(source, case, ctx, target)
    return ctx.timings


# --- campaign ---------------------------------------------------------------------------------


@dataclass
class ExampleEvent:
    """Progress of a campaign: sent when an example starts (``outcome`` None) and ends."""

    label: str  # "3/40", or "shrink 2" once a failure is being shrunk
    case: FuzzCase
    outcome: str | None = None  # "ok" or a FuzzFailure kind
    seconds: float = 0.0
    stage: str = ""


@dataclass
class FuzzReport:
    requested: int
    seed: int
    examples: int = 0  # run before the first failure was found (or all of them)
    shrink_runs: int = 0  # runs after it: Hypothesis shrinking the failure
    near_duplicates: int = 0  # skipped before running (see _Recorder.novel)
    outcomes: dict[str, int] = field(default_factory=dict)  # kind → examples (not shrink runs)
    failures: list[BaseException] = field(default_factory=list)  # final, minimal when shrunk
    seconds: float = 0.0
    example_seconds: list[float] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures

    def count(self, kind: str) -> int:
        return self.outcomes.get(kind, 0)


class _Recorder:
    """Runs each example Hypothesis draws, counts outcomes and reports progress."""

    def __init__(self, report: FuzzReport, check: Callable[[FuzzCase], object], progress):
        self.report, self.check, self.progress = report, check, progress
        self.failing = False  # once a failure is seen, Hypothesis is shrinking it
        self.seen: list[dict] = []

    def novel(self, case: FuzzCase) -> bool:
        """False for a case within ``NEAR_DUPLICATE`` fields of one already run in its family.

        Hypothesis follows each new example with up to ~5 mutations of it (a value copied
        from one place to another: one or two fields change); cheap tests gain from them, but
        at ~20 s an example they would spend most of a campaign next to a few configs.
        """
        fields = case.fields()
        for seen in self.seen:
            if seen["family"] == fields["family"]:
                if sum(seen[k] != v for k, v in fields.items()) <= NEAR_DUPLICATE:
                    return False
        self.seen.append(fields)
        return True

    def __call__(self, case: FuzzCase, keep_going: bool) -> None:
        report = self.report
        if not self.failing and not self.novel(case):  # never while shrinking
            report.near_duplicates += 1
            reject()
        if self.failing:
            report.shrink_runs += 1
            label = f"shrink {report.shrink_runs}"
        else:
            report.examples += 1
            label = f"{report.examples}/{report.requested}"
        self.progress(ExampleEvent(label, case))
        start = time.perf_counter()
        try:
            try:
                self.check(case)
            except FuzzFailure:
                raise
            except Exception as exc:  # a fault of the checks themselves: still reported
                raise Crash(case, "check", describe_exception(exc)) from exc
        except FuzzFailure as exc:
            self._done(label, case, exc.kind, start, exc.stage)
            if keep_going:
                report.failures.append(exc)
                return
            self.failing = True
            raise
        self._done(label, case, "ok", start)

    def _done(self, label: str, case: FuzzCase, outcome: str, start: float, stage="") -> None:
        seconds = time.perf_counter() - start
        if not self.failing:
            self.report.outcomes[outcome] = self.report.outcomes.get(outcome, 0) + 1
            self.report.example_seconds.append(seconds)
        self.progress(ExampleEvent(label, case, outcome, seconds, stage))


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions in an exception group (Hypothesis: several distinct bugs), flattened."""
    subs = getattr(exc, "exceptions", None)
    if isinstance(subs, tuple) and all(isinstance(e, BaseException) for e in subs):
        return [leaf for sub in subs for leaf in _leaves(sub)]
    return [exc]


@contextmanager
def _hypothesis_home(workdir: str | Path | None) -> Iterator[None]:
    """Hypothesis caches (source constants) go to a temporary directory, not ./.hypothesis."""
    import os

    from hypothesis import configuration

    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="tfgraph-fuzz-hypothesis-", dir=workdir) as home:
        configuration.set_hypothesis_home_dir(home)
        try:
            yield
        finally:
            configuration.set_hypothesis_home_dir(None)


def fuzz_settings(examples: int, *, shrink: bool = True) -> settings:
    """No deadline, no example database, the reproduction blob printed."""
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=False,  # the campaign seed is set explicitly (hypothesis.seed)
        print_blob=True,
        phases=phases,
        report_multiple_bugs=True,
        suppress_health_check=list(HealthCheck),
    )


def run_fuzz(
    examples: int,
    seed: int,
    *,
    targets: tuple[str, ...] = TARGETS,
    cache: bool = True,
    keep_going: bool = False,
    workdir: str | Path | None = None,
    progress: Callable[[ExampleEvent], None] = lambda event: None,
    check: Callable[..., object] = check_case,
) -> FuzzReport:
    """Check ``examples`` cases drawn with ``seed``; stops at the first failure and shrinks it
    (``keep_going``: runs them all, no shrinking). Failures are in the report, not raised."""
    if not targets:
        raise ValueError(f"targets {list(targets)}: choose from {', '.join(TARGETS)}")
    for name in targets:
        get_target(name, error=ValueError)
    report = FuzzReport(requested=examples, seed=seed)
    reproduce = _reproduce_command(examples, seed, targets, cache)
    recorder = _Recorder(
        report,
        lambda case: check(case, workdir, targets=targets, cache=cache, reproduce=reproduce),
        progress,
    )

    @fuzz_settings(examples, shrink=not keep_going)
    @hypothesis_seed(seed)
    @given(case=fuzz_cases())
    def fuzz(case: FuzzCase) -> None:
        recorder(case, keep_going)

    start = time.perf_counter()
    try:
        with _hypothesis_home(workdir):
            fuzz()
    except Exception as exc:  # FuzzFailure, a group of them, or a Hypothesis error
        report.failures.extend(_leaves(exc))
    report.seconds = time.perf_counter() - start
    return report


def _reproduce_command(examples: int, seed: int, targets: tuple[str, ...], cache: bool) -> str:
    command = f"python -m tfgraph fuzz --examples {examples} --seed {seed}"
    if tuple(targets) != TARGETS:
        command += f" --targets {','.join(targets)}"
    return command + ("" if cache else " --no-cache")
