"""Differential fuzzing: random zoo models through every profile, against eager PyTorch.

A Hypothesis strategy (:func:`fuzz_cases`) draws a :class:`FuzzCase`: a valid
:class:`~tfgraph.models.config.ModelConfig` from the whole space the zoo supports (family,
query/KV heads, head size, width, layers, positions, norm kind and placement, FFN, attention
implementation, sliding window, …; tiny: d_model ≤ 64, vocab ≤ 128) plus the inputs (parity
shapes, padding, weight and input seeds, generation prompts). :func:`check_case` builds the
module and, per profile, exports it (``tfgraph.export``) and checks

- parity against eager PyTorch passed;
- for every fusion kind, ``fused == total`` and ``total`` is the number of candidates the
  config has (the seed's ``(σ+ε)`` norm is never folded: it must be reported ``excluded``);
- decoders and encoder-decoders: the KV-cached export (``ort`` and one other profile) passes
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

import numpy as np
import torch
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

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
from tfgraph.targets import get_target

from .generation_parity import compare_greedy, encoder_inputs
from .sources import ModelSource, from_module
from .trace import TraceCache

logger = logging.getLogger(__name__)

MAX_D_MODEL = 64
MAX_SEQ_LEN = 64  # learned position tables; every sequence below stays shorter
MAX_PARITY_SEQ = 40
N_HEADS = (1, 2, 4, 3, 6, 8)
HEAD_DIMS = (8, 16, 4, 12, 6, 2, 10, 5)  # multiples of 8 and not, odd too
VOCABS = (64, 128, 50, 97)
ROPE_FRACTIONS = (1.0, 0.5, 0.25, 0.75)
PADDINGS = ("model", "none", "left", "single")  # of an attention_mask input (see _padding)
PROFILES = ("ort", "onnx", "tensorrt")  # the targets each example is exported for
CACHE_PROFILES = ("onnx", "tensorrt")  # the second profile of the KV-cached export
PRECISIONS = ("fp32", "fp16")  # drawn per case (every profile takes both)
GELU_FFNS = ("gelu", "gelu-tanh", "geglu")
SOFTCAPS = (50.0, 20.0, 5.0)  # Gemma 2 caps attention scores at 50
NEAR_DUPLICATE = 3  # fields: a case this close to one already run (same family) is skipped


# --- the case ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class FuzzCase:
    """One example: a model config and everything that picks its weights and inputs."""

    config: ModelConfig
    weight_seed: int = 0
    input_seed: int = 0
    parity_shapes: tuple[tuple[int, int], ...] = ((1, 7), (2, 33))  # (batch, sequence)
    padding: str = "model"
    prompt_lengths: tuple[int, int] = (6, 3)
    new_tokens: int = 4
    cache_profile: str = "onnx"
    precision: str = "fp32"  # every export of the case; fp16 adds islands and the fp16 rule

    def as_dict(self) -> dict:
        """Plain data (JSON-able) that :meth:`from_dict` turns back into this case."""
        out = dataclasses.asdict(self)
        out["parity_shapes"] = [list(s) for s in self.parity_shapes]
        out["prompt_lengths"] = list(self.prompt_lengths)
        return out

    def fields(self) -> dict:
        """Config and input fields in one flat dict (for the near-duplicate test)."""
        flat = self.as_dict()
        return {**flat.pop("config"), **{k: str(v) for k, v in flat.items()}}

    @classmethod
    def from_dict(cls, data: dict) -> FuzzCase:
        data = dict(data)
        data["config"] = ModelConfig(**data["config"])
        data["parity_shapes"] = tuple(tuple(s) for s in data.get("parity_shapes", ((1, 7),)))
        data["prompt_lengths"] = tuple(data.get("prompt_lengths", (6, 3)))
        return cls(**data)

    def prompts(self) -> list[list[int]]:
        """Batch-2 generation prompts of different lengths, token ids in [1, vocab)."""
        rng = np.random.default_rng(self.input_seed)
        vocab = self.config.vocab_size
        return [rng.integers(1, vocab, n).tolist() for n in self.prompt_lengths]

    def summary(self) -> str:
        return f"{describe_config(self.config)} | {self.describe_inputs()}"

    def describe_inputs(self) -> str:
        shapes = ",".join(f"{b}x{s}" for b, s in self.parity_shapes)
        prompts = "/".join(map(str, self.prompt_lengths))
        return (
            f"shapes {shapes} pad={self.padding} prompts {prompts}+{self.new_tokens} "
            f"seeds w{self.weight_seed}/i{self.input_seed}"
            + ("" if self.precision == "fp32" else f" {self.precision}")
        )


def describe_config(cfg: ModelConfig) -> str:
    """One line: the features that set the graph's shape."""
    heads = f"h={cfg.n_heads}" + (f"/kv={cfg.kv_heads}" if cfg.kv_heads != cfg.n_heads else "")
    positions = cfg.positions
    if cfg.positions == "rope":
        positions += f"({cfg.rotary_dim}/{cfg.head_dim}"
        positions += f",ntk{cfg.rope_ntk_factor:g})" if cfg.rope_ntk_factor != 1.0 else ")"
    elif cfg.positions == "t5":
        positions += f"({cfg.rel_buckets},{cfg.rel_max_distance})"
    elif cfg.positions == "shaw":
        positions += f"(k={cfg.shaw_max_distance})"
    norm = f"{cfg.norm}/{cfg.norm_placement}" + ("/parallel" if cfg.parallel_block else "")
    parts = [
        cfg.family,
        f"L{cfg.n_layers} d={cfg.d_model} {heads} hd={cfg.head_dim} ff={cfg.ffn_dim}",
        positions,
        norm,
        cfg.ffn,
        cfg.attn_impl,
    ]
    if cfg.sliding_window is not None:
        parts.append(f"window={cfg.sliding_window}")
    if cfg.mask_style != "add":
        parts.append(f"mask={cfg.mask_style}")
    if cfg.softcap is not None:
        parts.append(f"softcap={cfg.softcap:g}")
    if cfg.norm_order != "default":
        parts.append(f"norm-order={cfg.norm_order}")
    return " ".join(parts)


# --- strategies -------------------------------------------------------------------------------


def _flag(default: bool) -> st.SearchStrategy[bool]:
    """A boolean that shrinks to ``default``."""
    return st.booleans().map(lambda flip: flip != default)


def _divisors(n: int) -> list[int]:
    return [d for d in range(n, 0, -1) if n % d == 0]  # n first: MHA is the simplest


@st.composite
def _heads(draw) -> tuple[int, int | None, int]:
    """(n_heads, n_kv_heads, head_dim): MHA, GQA or MQA (kv divides q), d_model ≤ 64."""
    n_heads = draw(st.sampled_from(N_HEADS))
    head_dim = draw(st.sampled_from([h for h in HEAD_DIMS if h * n_heads <= MAX_D_MODEL]))
    kv = draw(st.sampled_from(_divisors(n_heads)))
    return n_heads, None if kv == n_heads else kv, head_dim


@st.composite
def _position_fields(draw, positions: str, head_dim: int) -> dict:
    """The parameters of the drawn position scheme (each valid for ``head_dim``).

    Every parameter is drawn whatever the scheme, and the unused ones dropped: the choice
    sequence keeps its layout when the shrinker changes the scheme or the head size.
    """
    fractions = [f for f in ROPE_FRACTIONS if int(head_dim * f) // 2 * 2 >= 2]
    fraction = draw(st.sampled_from(fractions))
    ntk = draw(st.sampled_from((1.0, 2.0, 4.0)))
    fields = {
        "learned": {"position_offset": draw(st.sampled_from((0, 2)))},
        "rope": {
            "rope_fraction": fraction,
            # NTK scaling needs a rotary width > 2
            "rope_ntk_factor": ntk if int(head_dim * fraction) // 2 * 2 > 2 else 1.0,
            "rope_theta": draw(st.sampled_from((10000.0, 500000.0))),
        },
        "t5": {  # max_distance above the exact range, ≥ 2 exact buckets per side
            "rel_buckets": draw(st.sampled_from((32, 8, 16, 12))),
            "rel_max_distance": draw(st.sampled_from((128, 20, 40))),
        },
        "shaw": {"shaw_max_distance": draw(st.sampled_from((8, 1, 2, 4, 16)))},
    }
    return fields.get(positions, {})


@st.composite
def model_configs(draw) -> ModelConfig:
    """A valid tiny :class:`ModelConfig` anywhere in the zoo's space."""
    family = draw(st.sampled_from(FAMILIES))
    n_heads, n_kv_heads, head_dim = draw(_heads())
    d_model = n_heads * head_dim
    positions = draw(st.sampled_from(POSITIONS))
    placement = draw(st.sampled_from(("pre", "post")))
    # drawn unconditionally, then applied where valid: the shrinker keeps its footing
    parallel = draw(_flag(False)) and placement == "pre" and family != "encoder-decoder"
    impl = draw(st.sampled_from(ATTN_IMPLS))
    impl = "explicit" if positions == "shaw" else impl  # SDPA cannot add Shaw's q·r term
    causal = family != "encoder"  # a window only acts on causal self-attention
    window = draw(st.one_of(st.none(), st.integers(1, 12)))
    window = window if causal else None
    norm = draw(st.sampled_from(NORMS))
    mask_style = draw(st.sampled_from(MASK_STYLES))
    is_causal_ok = impl == "sdpa" and causal and positions not in ("alibi", "t5") and not window
    if mask_style != "add" and impl == "sdpa":  # SDPA selects nothing; it may be is_causal
        mask_style = "is-causal" if is_causal_ok else "add"
    elif mask_style == "is-causal":  # explicit attention: a selection mask instead
        mask_style = "select-fill"
    softcap = draw(st.one_of(st.none(), st.sampled_from(SOFTCAPS)))
    # SDPA cannot cap; Shaw's q·r sits inside the cap, where no kernel adds it (a stated miss)
    softcap = softcap if impl == "explicit" and positions != "shaw" else None
    norm_order = draw(st.sampled_from(NORM_ORDERS))
    norm_order = "default" if norm == "layernorm-seed" else norm_order
    return ModelConfig(
        family=family,
        vocab_size=draw(st.sampled_from(VOCABS)),
        d_model=d_model,
        n_layers=draw(st.integers(1, 2)),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_ff=draw(st.one_of(st.none(), st.integers(8, 96))),
        max_seq_len=MAX_SEQ_LEN,
        positions=positions,
        sliding_window=window,
        norm=norm,
        norm_placement=placement,
        norm_eps=draw(st.sampled_from((1e-5, 1e-6, 1e-12))),
        embed_norm=draw(_flag(False)),
        embed_scale=draw(_flag(False)),
        parallel_block=parallel,
        ffn=draw(st.sampled_from(FFNS)),
        bias=draw(_flag(True)),
        tie_embeddings=draw(_flag(True)),
        num_labels=draw(st.integers(1, 3)),
        scale_scores=draw(_flag(True)),
        attn_impl=impl,
        mask_style=mask_style,
        softcap=softcap,
        norm_order=norm_order,
        **draw(_position_fields(positions, head_dim)),
    )


@st.composite
def _prompt_lengths(draw) -> tuple[int, int]:
    """Two different lengths in 1 … 8, so the batch is left-padded."""
    first = draw(st.integers(1, 8))
    second = draw(st.integers(1, 7))
    return first, second + (second >= first)


@st.composite
def fuzz_cases(draw) -> FuzzCase:
    """A :class:`FuzzCase`: a config from :func:`model_configs` and its inputs."""
    shape = st.tuples(st.integers(1, 3), st.integers(1, MAX_PARITY_SEQ))
    return FuzzCase(
        config=draw(model_configs()),
        weight_seed=draw(st.integers(0, 2**16)),
        input_seed=draw(st.integers(0, 2**16)),
        parity_shapes=tuple(draw(st.lists(shape, min_size=1, max_size=2, unique=True))),
        padding=draw(st.sampled_from(PADDINGS)),
        prompt_lengths=draw(_prompt_lengths()),
        new_tokens=draw(st.integers(2, 6)),
        cache_profile=draw(st.sampled_from(CACHE_PROFILES)),
        precision=draw(st.sampled_from(PRECISIONS)),
    )


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


def _padding(mode: str, batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """An attention mask (1 on tokens): row 0 always full, so every row keeps a token."""
    mask = torch.ones(batch, seq, dtype=torch.int64)
    if mode == "none":
        return mask
    lengths = torch.randint(1, seq + 1, (batch,), generator=generator)
    lengths[0] = seq
    if mode == "single":
        lengths[1:] = 1
    for row, length in enumerate(lengths.tolist()):
        if mode == "left":
            mask[row, : seq - length] = 0
        else:
            mask[row, length:] = 0
    return mask


def case_source(case: FuzzCase) -> ModelSource:
    """The case's module (``build(config, seed=weight_seed)``) with its input seed and padding."""
    from tfgraph.models import build

    source = from_module(build(case.config, seed=case.weight_seed), origin="fuzz")
    make = source.make_inputs

    def make_inputs(batch: int, seq: int, generator: torch.Generator) -> dict:
        mixed = generator.initial_seed() * 1_000_003 + case.input_seed
        generator = torch.Generator().manual_seed(mixed % 2**63)
        inputs = make(batch, seq, generator)
        if "attention_mask" in inputs and case.padding != "model":
            inputs["attention_mask"] = _padding(case.padding, batch, seq, generator)
        return inputs

    return dataclasses.replace(source, make_inputs=make_inputs)


def expected_candidates(cfg: ModelConfig) -> dict[str, int]:
    """Fusion candidates the config's graph has: attention cores, norms, GELUs."""
    cross = cfg.family == "encoder-decoder"
    stacks = 2 if cross else 1  # each with its own embeddings
    per_block = 1 if cfg.parallel_block else 2
    norms = stacks * cfg.n_layers * per_block + cross * cfg.n_layers
    norms += stacks * (int(cfg.final_norm) + int(cfg.embed_norm))
    return {
        "attention": cfg.n_layers * (3 if cross else 1),
        "norm": norms,
        "gelu": stacks * cfg.n_layers * (cfg.ffn in GELU_FFNS),
    }


def _softcap_miss(missed: dict) -> bool:
    reason = str(missed.get("reason", ""))
    return "softcap" in reason or "soft-capped" in reason


def fusion_problems(cfg: ModelConfig, fusions: dict) -> list[str]:
    """Every fusion kind complete; the seed norm reported excluded, never counted."""
    want = expected_candidates(cfg)
    seed_norm = cfg.norm == "layernorm-seed"
    problems = []
    for kind, counts in fusions.items():
        excluded = [m for m in counts["missed"] if m.get("excluded")]
        expected = 0 if kind == "norm" and seed_norm else want.get(kind, counts["total"])
        # soft-capped attention a target states it cannot fuse (TensorRT; ORT's MHA path)
        capped = [m for m in counts["missed"] if cfg.softcap and _softcap_miss(m)]
        if not counts["fused"] + len(capped) == counts["total"] == expected:
            missed = [m for m in counts["missed"] if not m.get("excluded")][:3]
            problems.append(
                f"{kind}: fused {counts['fused']}/{counts['total']}, expected {expected}; "
                f"missed {missed}"
            )
        want_excluded = want["norm"] if kind == "norm" and seed_norm else 0
        if len(excluded) != want_excluded:
            problems.append(f"{kind}: {len(excluded)} excluded, expected {want_excluded}")
    return problems


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
    source: ModelSource, case: FuzzCase, ctx: CaseContext, out: Path, profile: str, kv_cache: bool
):
    from .exporting import export

    return export(
        source,
        out,
        profile=profile,
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


def check_export(source: ModelSource, case: FuzzCase, ctx: CaseContext, profile: str) -> None:
    """Uncached export at ``profile``: parity and complete fusions."""
    stage = f"export profile={profile}"
    with ctx.stage(case, stage):
        result = _export(source, case, ctx, ctx.workdir / profile, profile, kv_cache=False)
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


def check_cached(source: ModelSource, case: FuzzCase, ctx: CaseContext, profile: str) -> None:
    """KV-cached export at ``profile``: cache parity, fusions, greedy generation vs eager."""
    from tfgraph.runtime import CachedDecoder, Session

    stage = f"export --kv-cache profile={profile}"
    out = ctx.workdir / f"{profile}-kv"
    with ctx.stage(case, stage):
        result = _export(source, case, ctx, out, profile, kv_cache=True)
    _check_report(case, ctx, stage, result.report)
    if case.precision != "fp32":  # its cache parity used the precision's rule; fp16 logits
        return  # of a random model tie often, so tokens against fp32 eager say little
    stage = f"generate profile={profile}"
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


def cache_profiles(case: FuzzCase, profiles: tuple[str, ...]) -> list[str]:
    """``ort`` and the case's other profile, among those asked for (else the first asked)."""
    chosen = [p for p in ("ort", case.cache_profile) if p in profiles]
    return chosen or list(profiles[:1])


def check_case(
    case: FuzzCase,
    workdir: str | Path | None = None,
    *,
    profiles: tuple[str, ...] = PROFILES,
    cache: bool = True,
    reproduce: str = "",
) -> dict[str, float]:
    """Run every check on ``case``; raises :class:`FuzzFailure`. Returns stage timings."""
    with tempfile.TemporaryDirectory(prefix="tfgraph-fuzz-", dir=workdir) as tmp:
        ctx = CaseContext(Path(tmp), reproduce)
        with ctx.stage(case, "build"):
            source = case_source(case)
        for profile in profiles:
            check_export(source, case, ctx, profile)
        if cache and case.config.family != "encoder":
            for profile in cache_profiles(case, profiles):
                check_cached(source, case, ctx, profile)
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
    profiles: tuple[str, ...] = PROFILES,
    cache: bool = True,
    keep_going: bool = False,
    workdir: str | Path | None = None,
    progress: Callable[[ExampleEvent], None] = lambda event: None,
    check: Callable[..., object] = check_case,
) -> FuzzReport:
    """Check ``examples`` cases drawn with ``seed``; stops at the first failure and shrinks it
    (``keep_going``: runs them all, no shrinking). Failures are in the report, not raised."""
    if not profiles:
        raise ValueError(f"profiles {list(profiles)}: choose from {', '.join(PROFILES)}")
    for name in profiles:
        get_target(name, error=ValueError)
    report = FuzzReport(requested=examples, seed=seed)
    reproduce = _reproduce_command(examples, seed, profiles, cache)
    recorder = _Recorder(
        report,
        lambda case: check(case, workdir, profiles=profiles, cache=cache, reproduce=reproduce),
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


def _reproduce_command(examples: int, seed: int, profiles: tuple[str, ...], cache: bool) -> str:
    command = f"python -m tfgraph fuzz --examples {examples} --seed {seed}"
    if tuple(profiles) != PROFILES:
        command += f" --profiles {','.join(profiles)}"
    return command + ("" if cache else " --no-cache")
