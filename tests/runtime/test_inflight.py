"""In-flight batching (tfgraph.runtime.inflight): requests join a running batch in free cache
slots and leave it when they end; every request's tokens equal ``generate`` on its prompt
alone, and each step's logits are within the fp32 parity tolerance of that run.

The models cover the ways positions reach a row: learned position rows without a mask
(gpt-tiny), RoPE (llama-tiny), a sliding window (mistral-tiny), Hugging Face Llama and
GPT-2 with positions from ``attention_mask``, a model written with PyTorch's own
``F.scaled_dot_product_attention(is_causal=True)``, ALiBi (bloom-tiny, mpt-tiny-sdpa: a bias
over queries × keys read shifted along the keys per row), and ``nn.MultiheadAttention`` with
no positions at all (the per-row lengths only the kernel reads); encoder-decoders hold their
cross K/V per slot (T5's relative buckets shifted like ALiBi). A control feeds every row the
longest row's length instead of its own: the logits part, so the comparison can fail."""

import json

import numpy as np
import pytest
from idiom_models import GPT, absolute_bias_lm, mha_lm, t5_decoder
from idiom_models import gpt as sdpa_gpt

import tfgraph
from tests.e2e.test_generation_parity import MaskedLM, transformers_model
from tests.e2e.test_hf_pipelines import CONFIGS, SMALL
from tfgraph.errors import TfgraphError
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, SlotBatcher, generate
from tfgraph.runtime import session as session_module
from tfgraph.runtime.generate import seq2seq_prompts
from tfgraph.runtime.inflight import generate_inflight, inflight_support
from tfgraph.sources import load_source

ATOL = 1e-4  # the fp32 parity tolerance (a batched step against a batch of one)
ARRIVALS = [0, 0, 2, 3, 5, 9, 9]  # more requests than slots: some wait, slots are reused
SLOTS = 3


def sdpa_gpt_heads(head_size: int):
    import torch

    torch.manual_seed(0)
    return GPT(d=2 * head_size, h=2).eval()


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(1, vocab, n).tolist() for n in (3, 9, 5, 12, 2, 7, 1)]


def _configs():
    limits = [12, 5, 9, 3, 12, 1, 6]  # a one-token request ends at its prefill
    return [GenerationConfig(max_new_tokens=n) for n in limits]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    import torch

    root = tmp_path_factory.mktemp("hf_inflight")
    paths = {}
    for name in ("llama", "gpt2", "bart", "t5", "bloom", "mpt"):
        cls, cfg, kwargs = CONFIGS.get(name) or MPT
        config = getattr(transformers, cfg)(**{**SMALL, **kwargs})
        torch.manual_seed(0)
        getattr(transformers, cls)(config).eval().save_pretrained(root / name)
        paths[name] = root / name
    return paths


# Hugging Face MPT: ALiBi sliced from a 2048-position buffer (shape inference loses the query
# axis of its bias) plus the causal and padding mask
MPT = ("MptForCausalLM", "MptConfig", {"n_layers": 2, "d_model": 64, "n_heads": 4})


def _source(case, hf_dirs):
    if case == "sdpa_gpt":
        return tfgraph.from_module(sdpa_gpt(), origin="sdpa_gpt")
    if case == "mha_lm":  # nn.MultiheadAttention, no position machinery
        return tfgraph.from_module(mha_lm(), origin="mha_lm")
    if case == "t5_decoder":  # T5's relative buckets in a decoder-only model
        return tfgraph.from_module(t5_decoder(), origin="t5_decoder")
    if case.startswith("hf:"):  # a directory, as the CLI takes it (T5 retries with eager)
        return str(hf_dirs[case[3:]])
    if case == "masked:gpt2":
        return tfgraph.from_module(MaskedLM(transformers_model(hf_dirs["gpt2"])), origin=case)
    return load_source(case)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, hf_dirs):
    root = tmp_path_factory.mktemp("inflight")
    made = {}

    def get(case, target="ort"):
        if (case, target) not in made:
            path = root / f"{case.replace(':', '_')}-{target}"
            result = tfgraph.export(_source(case, hf_dirs), path, kv_cache=True, target=target)
            assert result.manifest["kv_layout"]["row_lengths"] == "past_sequence_lengths"
            assert result.manifest["kv_layout"]["kind"] == (
                "shared" if target == "ort" else "static"
            )
            made[(case, target)] = path
        return made[(case, target)]

    return get


def _feed_every_row_the_longest_length(monkeypatch) -> None:
    """The control: the session's rows all get the longest row's past length."""
    rows = session_module.Session.rows

    def uniform(self, cache, start, stop, lengths):
        out = rows(self, cache, start, stop, lengths)
        out.lengths = np.full(len(out.lengths), out.length, np.int64)
        return out

    monkeypatch.setattr(session_module.Session, "rows", uniform)


def _vocab(decoder) -> int:
    return min(50, decoder.session.signature.output("logits").shape[-1])


CASES = [
    *[(c, "ort") for c in ("gpt-tiny", "llama-tiny", "mistral-tiny", "hf:llama", "masked:gpt2",
                           "sdpa_gpt", "bloom-tiny", "mpt-tiny-sdpa", "mha_lm", "t5_decoder",
                           # ALiBi built from attention_mask (BLOOM) or sliced from a buffer
                           # (MPT), in a bias that also masks: the mask moves with each row
                           "hf:bloom")],
    pytest.param("hf:mpt", "ort", marks=pytest.mark.slow),  # slow: 7 s; hf:bloom's ALiBi stays
    # the static standard-ONNX cache: TensorScatter writes each row at its own length, the
    # causal mask is per row
    *[(c, "onnx") for c in ("gpt-tiny", "llama-tiny", "masked:gpt2", "mha_lm", "t5_decoder")],
]  # fmt: skip


@pytest.mark.parametrize("case, target", CASES)
def test_greedy_requests_equal_generate_alone(case, target, artifacts):
    decoder = CachedDecoder(Session(artifacts(case, target)))
    prompts, configs = _prompts(_vocab(decoder)), _configs()
    got = generate_inflight(
        decoder, prompts, configs, arrivals=ARRIVALS, slots=SLOTS, keep_logits=True
    )
    for prompt, config, request in zip(prompts, configs, got, strict=True):
        alone = generate(decoder, [prompt], config, keep_logits=True)
        assert request.tokens == alone.tokens[0]
        assert len(request.logits) == config.max_new_tokens
        for mine, theirs in zip(request.logits, alone.step_logits, strict=True):
            np.testing.assert_allclose(mine, theirs[0], atol=ATOL, rtol=0)


SAMPLED = [("gpt-tiny", "ort"), ("llama-tiny", "onnx"), ("t5_decoder", "onnx")]


@pytest.mark.parametrize("case, target", SAMPLED)
def test_seeded_sampling_equals_generate_alone(case, target, artifacts):
    """Sampled tokens vary where a random model's greedy tokens repeat one (T5's decoder):
    over keys that are all one token any weighting gives the same output, so this is where a
    wrong per-row bias shows."""
    decoder = CachedDecoder(Session(artifacts(case, target)))
    prompts = _prompts(_vocab(decoder))
    config = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=3.0, top_k=30)
    seeds = list(range(len(prompts)))
    got = generate_inflight(
        decoder, prompts, config, arrivals=ARRIVALS, seeds=seeds, slots=4, capacity=24,
        encoder_capacity=16, keep_logits=True,
    )  # fmt: skip
    for prompt, seed, request in zip(prompts, seeds, got, strict=True):
        start, extra = [prompt], {}
        if decoder.seq2seq:
            start, extra = seq2seq_prompts(decoder, [prompt], 0, 0)
        config_alone = GenerationConfig(**{**vars(config), "seed": seed})
        alone = generate(decoder, start, config_alone, extra=extra, keep_logits=True)
        assert request.tokens == alone.tokens[0]
        for mine, theirs in zip(request.logits, alone.step_logits, strict=True):
            np.testing.assert_allclose(mine, theirs[0], atol=ATOL, rtol=0)
    assert len({tuple(r.tokens) for r in got}) > 1  # sampling at temperature 3 varies


def test_rows_at_the_longest_length_would_be_wrong(artifacts, monkeypatch):
    """The control: every row fed the longest row's past length attends to keys it does
    not have, and its logits part from generate alone."""
    decoder = CachedDecoder(Session(artifacts("llama-tiny")))
    prompts, configs = _prompts(_vocab(decoder)), _configs()
    _feed_every_row_the_longest_length(monkeypatch)
    got = generate_inflight(
        decoder, prompts, configs, arrivals=ARRIVALS, slots=SLOTS, keep_logits=True
    )
    worst = 0.0
    for prompt, config, request in zip(prompts, configs, got, strict=True):
        alone = generate(decoder, [prompt], config, keep_logits=True)
        for mine, theirs in zip(request.logits, alone.step_logits, strict=False):
            worst = max(worst, float(np.abs(mine - theirs[0]).max()))
    assert worst > 100 * ATOL


def test_slots_free_at_once_and_refuse_what_does_not_fit(artifacts):
    decoder = CachedDecoder(Session(artifacts("llama-tiny")))
    batcher = SlotBatcher(decoder, slots=2, capacity=16)
    a = batcher.admit([1, 2, 3], GenerationConfig(max_new_tokens=8))
    b = batcher.admit([4, 5], GenerationConfig(max_new_tokens=8))
    assert (a.slot, b.slot, batcher.free) == (0, 1, 0)
    with pytest.raises(TfgraphError, match="all 2 slots are busy"):
        batcher.admit([6], GenerationConfig(max_new_tokens=2))
    batcher.step()
    batcher.release(a.slot)  # a cancelled request: its slot is free before the next step
    assert batcher.free == 1 and set(batcher.active) == {1}
    c = batcher.admit([7, 8, 9], GenerationConfig(max_new_tokens=8))
    assert c.slot == 0
    steps = batcher.step()
    assert set(steps) == {0, 1}
    with pytest.raises(TfgraphError, match="needs 20 positions but a slot holds 16"):
        batcher.check([1] * 13, GenerationConfig(max_new_tokens=8))
    assert batcher.kv_bytes_per_slot() == 2 * 2 * 2 * 16 * 8 * 4  # layers, K/V, kv heads, …


def test_artifacts_without_row_lengths_are_refused_with_the_reason(tmp_path):
    # an ort layer lowered to MultiHeadAttention (head size 12: not a multiple of 8) keeps the
    # copying cache: no buffer rows to batch
    odd = tfgraph.from_module(sdpa_gpt_heads(12), origin="odd_heads")
    copying = tfgraph.export(odd, tmp_path / "mha", kv_cache=True, target="ort")
    assert copying.manifest["kv_layout"]["row_lengths"] is None
    decoder = CachedDecoder(Session(tmp_path / "mha"))
    assert "per-row past lengths" in inflight_support(decoder)
    with pytest.raises(TfgraphError, match="in-flight batching is not available"):
        SlotBatcher(decoder, slots=2, capacity=8)


SEQ2SEQ = [
    pytest.param("bart-tiny", "ort", marks=pytest.mark.slow),  # slow: 10 s; hf:bart stays
    # slow: 12 s; t5-tiny and hf:bart stay (ort), decoders in flight on onnx stay (test_kv_int8)
    pytest.param("transformer-tiny", "onnx", marks=pytest.mark.slow),
    ("t5-tiny", "ort"),
    # Hugging Face classes as loaded from a directory: no attention_mask input, so the cache
    # pass adds the encoder mask the slots need
    ("hf:bart", "ort"),
    pytest.param("hf:t5", "onnx", marks=pytest.mark.slow),  # slow: 55 s; hf:bart stays
]  # fmt: skip


@pytest.mark.parametrize("case, target", SEQ2SEQ)
def test_encoder_decoder_requests_equal_generate_alone(case, target, artifacts):
    """Each slot holds its request's cross K/V (the encoder run on its prompt alone, padded
    to the slot's encoder capacity and masked)."""
    decoder = CachedDecoder(Session(artifacts(case, target)))
    assert inflight_support(decoder) is None
    prompts, configs = _prompts(_vocab(decoder)), _configs()
    got = generate_inflight(
        decoder, prompts, configs, arrivals=ARRIVALS, slots=SLOTS, capacity=16,
        encoder_capacity=16, keep_logits=True,
    )  # fmt: skip
    for prompt, config, request in zip(prompts, configs, got, strict=True):
        start, extra = seq2seq_prompts(decoder, [prompt], 0, 0)
        alone = generate(decoder, start, config, extra=extra, keep_logits=True)
        assert request.tokens == alone.tokens[0]
        for mine, theirs in zip(request.logits, alone.step_logits, strict=True):
            np.testing.assert_allclose(mine, theirs[0], atol=ATOL, rtol=0)
    with pytest.raises(TfgraphError, match="more than the 16 encoder positions"):
        SlotBatcher(decoder, 2, 16, encoder_capacity=16).check([1] * 17, configs[0])


def test_an_encoder_decoder_without_an_encoder_mask_gets_one(artifacts):
    """Hugging Face BART as loaded from a directory takes no attention_mask: the cache pass
    gives its step graph one (role encoder_slot_mask) for the cross-attention alone, so a
    slot masks the padding of its cross K/V; the encoder file does not take it, and
    ``generate`` feeds it ones (the model as written). The control: cross K/V padded with
    garbage and the mask's padding opened up changes the logits, so the mask is what keeps
    the padding out."""
    path = artifacts("hf:bart")
    manifest = json.loads((path / "manifest.json").read_text())
    roles = {p["name"]: p["role"] for p in manifest["graphs"]["model.onnx"]["inputs"]}
    assert roles.get("encoder_slot_mask") == "encoder_slot_mask"
    assert "encoder_attention_mask" not in roles.values()
    encoder = {p["role"] for p in manifest["graphs"]["encoder.onnx"]["inputs"]}
    assert "encoder_slot_mask" not in encoder
    decoder = CachedDecoder(Session(path))
    assert inflight_support(decoder) is None
    start, extra = seq2seq_prompts(decoder, [[5, 6, 7]], 0, 0)
    cross = decoder.encode(extra)
    cache = decoder.empty_cache(1, 4)
    masked, _ = decoder.step(np.asarray(start), cache, None, {**extra, **_padded(cross, 2)})
    alone, _ = decoder.step(np.asarray(start), decoder.empty_cache(1, 4), None, {**extra, **cross})
    np.testing.assert_allclose(masked, alone, atol=ATOL, rtol=0)
    opened = {**extra, **_padded(cross, 2), "encoder_slot_mask": np.ones((1, 5), np.int64)}
    leaked, _ = decoder.step(np.asarray(start), decoder.empty_cache(1, 4), None, opened)
    assert np.abs(leaked - alone).max() > 100 * ATOL


def _padded(cross: dict, extra_positions: int) -> dict:
    """Cross K/V (OrtValues) with ``extra_positions`` garbage positions after the real ones,
    and the encoder mask that hides them."""
    rng = np.random.default_rng(0)
    out = {}
    for name, value in cross.items():
        array = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
        noise = rng.normal(0, 3, (*array.shape[:2], extra_positions, array.shape[3]))
        out[name] = np.concatenate([array, noise.astype(array.dtype)], axis=2)
    length = next(iter(out.values())).shape[2]
    mask = np.zeros((1, length), np.int64)
    mask[:, : length - extra_positions] = 1
    out["encoder_slot_mask"] = mask
    return out


@pytest.mark.parametrize(
    "case, why",
    [
        ("shaw-tiny", "Einsum reads positions"),
        ("absolute_bias_lm", "does not move with left padding"),
    ],
)
def test_machinery_rows_cannot_read_shifted_keeps_one_past_length(case, why, tmp_path):
    """Shaw's relative keys are (queries × keys × size) machinery read by an Einsum with the
    queries; a bias over absolute (query, key) positions with the padding mask in it is
    neither a function of i − j nor moved by left padding. Such a graph keeps one past
    length (the slice), passes parity, says why, and serves with static batching."""
    source = (
        tfgraph.from_module(absolute_bias_lm(), origin=case)
        if case == "absolute_bias_lm"
        else load_source(case)
    )
    result = tfgraph.export(source, tmp_path / "a", kv_cache=True)
    layout = result.manifest["kv_layout"]
    assert result.passed and layout["row_lengths"] is None
    assert why in layout["row_lengths_refused"]
    assert why in inflight_support(CachedDecoder(Session(tmp_path / "a")))


@pytest.mark.parametrize("case, broken", [("t5_decoder", "shift"), ("hf:bloom", "mask")])
def test_a_bias_read_unshifted_fails_the_exports_row_parity(
    case, broken, tmp_path, monkeypatch, hf_dirs
):
    """The controls of the key shift: every row reading the common slice of T5's relative
    bias unshifted (keys as the longest row sees them), or BLOOM's mask-built ALiBi computed
    on the mask as it lies (not left-padded to the longest row), is caught by export's row
    parity: the export fails. (ALiBi alone, linear in j − i, is the one bias the shift changes
    only by a constant per row, which the softmax ignores; and a random T5's decoder tends to
    repeat one token, over which any weighting is the same: a decoder-only T5 is the
    control.)"""
    import tfgraph.passes.cache.row_lengths as row_lengths

    shifted = row_lengths.RowGather.shifted

    def no_shift(self, sliced, past_len):  # F − P_b replaced by 0 for every row
        lengths, self.lengths = self.lengths, past_len
        try:
            return shifted(self, sliced, past_len)
        finally:
            self.lengths = lengths

    def mask_as_it_lies(self, rewriter, value, axes, seq):
        return rewriter.last_rows(value, axes)

    if broken == "shift":
        monkeypatch.setattr(row_lengths.RowGather, "shifted", no_shift)
    else:
        monkeypatch.setattr(row_lengths.RowGather, "left_padded", mask_as_it_lies)
    result = tfgraph.export(_source(case, hf_dirs), tmp_path / "a", kv_cache=True)
    rows = result.report["parity"]["rows"]
    assert not result.passed and not rows["passed"]
    assert rows["max_abs_err"] > 10 * ATOL


def test_every_row_length_artifact_proves_rows_at_their_own_lengths(artifacts, monkeypatch):
    """Export's cache parity runs three requests through two slots against each alone
    (``parity.rows``); with every row fed the longest row's length it fails."""
    from tfgraph.verify.row_parity import check_row_parity
    from tfgraph.verify.tolerance import FP32

    path = artifacts("llama-tiny")
    report = json.loads((path / "report.json").read_text())["parity"]["rows"]
    assert report["passed"] and report["requests"] == 3 and report["max_abs_err"] < ATOL
    _feed_every_row_the_longest_length(monkeypatch)
    decoder = CachedDecoder(Session(path, checking=True))
    broken = check_row_parity(load_source("llama-tiny"), decoder, FP32)
    assert not broken["passed"] and broken["max_abs_err"] > 100 * ATOL


# -- chunked prefill ------------------------------------------------------------------------


# slow: 17 s, an int8 export of its own; the fp32 case stays in the default tier
KV_DTYPES = ["fp32", pytest.param("int8", marks=pytest.mark.slow)]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_chunk_over_a_past_gives_the_whole_prompts_logits(kv_dtype, artifacts, tmp_path):
    """GroupQueryAttention over the shared buffer: a prompt run as chunks of 5, 11, 1 and 4
    tokens, each at its row's past length, gives the logits of the prompt run whole (the
    int8 cache too: the kernel quantizes each appended key the same way)."""
    path = artifacts("llama-tiny")
    if kv_dtype == "int8":
        path = tmp_path / "int8"
        tfgraph.export(load_source("llama-tiny"), path, kv_cache=True, kv_dtype="int8")
    decoder = CachedDecoder(Session(path))
    prompt = np.random.default_rng(0).integers(1, _vocab(decoder), (1, 21))
    session = decoder.session
    whole, _ = decoder.step(prompt, session.rows(session.new_cache(1, 32), 0, 1, [0]))
    cache, parts = session.new_cache(1, 32), []
    for start, stop in [(0, 5), (5, 16), (16, 17), (17, 21)]:
        rows = session.rows(cache, 0, 1, [start])
        logits, _ = decoder.step(prompt[:, start:stop], rows, np.ones((1, stop), np.int64))
        parts.append(logits)
    np.testing.assert_allclose(np.concatenate(parts, axis=1), whole, atol=ATOL, rtol=0)
    # the control: the last chunk read at a past length one short attends to one key fewer
    rows = session.rows(cache, 0, 1, [16])
    short, _ = decoder.step(prompt[:, 17:21], rows, np.ones((1, 20), np.int64))
    assert np.abs(short - parts[-1]).max() > 100 * ATOL


CHUNKED = [("llama-tiny", "ort"), ("gpt-tiny", "ort"), ("hf:llama", "ort"), ("llama-tiny", "onnx")]


@pytest.mark.parametrize("case, target", CHUNKED)
def test_chunked_prefill_gives_the_tokens_of_whole_prefill(case, target, artifacts):
    """Prompts entering 4 tokens a step, interleaved with the running decodes: every
    request's tokens and logits are those of ``generate`` on its prompt alone."""
    decoder = CachedDecoder(Session(artifacts(case, target)))
    prompts, configs = _prompts(_vocab(decoder)), _configs()
    got = generate_inflight(
        decoder, prompts, configs, arrivals=ARRIVALS, slots=SLOTS, keep_logits=True,
        prefill_chunk=4,
    )  # fmt: skip
    for prompt, config, request in zip(prompts, configs, got, strict=True):
        alone = generate(decoder, [prompt], config, keep_logits=True)
        assert request.tokens == alone.tokens[0]
        for mine, theirs in zip(request.logits, alone.step_logits, strict=True):
            np.testing.assert_allclose(mine, theirs[0], atol=ATOL, rtol=0)


def test_a_long_prompt_enters_in_chunks_between_the_decodes(artifacts):
    """With a budget of 4 prompt tokens a step, a 14-token prompt takes its slot at once and
    its first token comes at the fourth step; the running request gets a token at every
    step meanwhile."""
    decoder = CachedDecoder(Session(artifacts("llama-tiny")))
    batcher = SlotBatcher(decoder, slots=2, capacity=32, prefill_chunk=4)
    a = batcher.admit([1, 2, 3], GenerationConfig(max_new_tokens=10))
    assert a.prefilling and batcher.advance() == {0: [a.tokens[0]]}
    b = batcher.admit(list(range(1, 15)), GenerationConfig(max_new_tokens=3))
    assert b.prefilling and b.slot == 1 and batcher.free == 0
    seen = [batcher.advance() for _ in range(4)]
    assert [sorted(s) for s in seen] == [[0], [0], [0], [0, 1]]
    assert b.length == 14 and not b.prefilling and seen[-1][1] == b.tokens
    alone = generate(decoder, [list(range(1, 15))], GenerationConfig(max_new_tokens=3))
    while batcher.active:
        batcher.advance()
    assert b.tokens == alone.tokens[0]
    with pytest.raises(TfgraphError, match="must be >= 0"):
        SlotBatcher(decoder, slots=2, capacity=32, prefill_chunk=-1)
