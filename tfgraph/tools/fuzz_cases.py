"""The fuzzer's case space: :class:`FuzzCase`, the Hypothesis strategies that draw it, the
module it builds and the fusions it should get.

:func:`fuzz_cases` draws a :class:`FuzzCase`: a valid :class:`~tfgraph.models.config.ModelConfig`
from the whole space the zoo supports (:func:`model_configs`) plus its inputs (parity shapes,
padding, weight and input seeds, generation prompts). :func:`case_source` builds the case's
module as a :class:`~tfgraph.sources.ModelSource`; :func:`expected_candidates` counts the fusion
candidates its graph has and :func:`fusion_problems` compares an export's fusion report with
them. The checks and the campaign are in :mod:`tfgraph.tools.fuzz`, which imports this module
(never the other way round).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
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
from tfgraph.sources import ModelSource, from_module

MAX_D_MODEL = 64
MAX_SEQ_LEN = 64  # learned position tables; every sequence below stays shorter
MAX_PARITY_SEQ = 40
N_HEADS = (1, 2, 4, 3, 6, 8)
HEAD_DIMS = (8, 16, 4, 12, 6, 2, 10, 5)  # multiples of 8 and not, odd too
VOCABS = (64, 128, 50, 97)
ROPE_FRACTIONS = (1.0, 0.5, 0.25, 0.75)
PADDINGS = ("model", "none", "left", "single")  # of an attention_mask input (see _padding)
TARGETS = ("ort", "onnx", "tensorrt")  # the targets each example is exported for
CACHE_TARGETS = ("onnx", "tensorrt")  # the second target of the KV-cached export
PRECISIONS = ("fp32", "fp16")  # drawn per case (every target takes both)
GELU_FFNS = ("gelu", "gelu-tanh", "geglu")
SOFTCAPS = (50.0, 20.0, 5.0)  # Gemma 2 caps attention scores at 50


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
    cache_target: str = "onnx"
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
        if "cache_profile" in data:  # replay JSON printed before the key was renamed
            data["cache_target"] = data.pop("cache_profile")
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
        cache_target=draw(st.sampled_from(CACHE_TARGETS)),
        precision=draw(st.sampled_from(PRECISIONS)),
    )


# --- building and expecting a case -----------------------------------------------------------


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
