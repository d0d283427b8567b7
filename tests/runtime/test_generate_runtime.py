"""The generation runtime's pieces (padding, token choice, EOS, config checks) and the
``generate`` CLI on a cached artifact."""

import numpy as np
import pytest

import tfgraph
from tfgraph.cli import main
from tfgraph.errors import TfgraphError
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, generate
from tfgraph.runtime.generate import choose, left_pad


@pytest.fixture(scope="module")
def cached_gpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("cached") / "gpt-tiny"
    result = tfgraph.export("gpt-tiny", out, kv_cache=True)
    assert result.passed
    return out


def test_left_pad_right_aligns_and_masks():
    ids, mask = left_pad([[5, 6, 7], [9]], pad=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(tfgraph.TfgraphError, match="at least one token"):
        left_pad([[1], []], pad=0)


def test_greedy_is_argmax():
    logits = np.array([[0.1, 3.0, 2.9], [5.0, -1.0, 4.0]])
    assert choose(logits, GenerationConfig(), np.random.default_rng(0)).tolist() == [1, 0]


def test_top_k_1_and_tiny_top_p_are_greedy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((4, 50))
    for config in (
        GenerationConfig(do_sample=True, top_k=1, seed=0),
        GenerationConfig(do_sample=True, top_p=1e-6, seed=0),
    ):
        assert (choose(logits, config, np.random.default_rng(1)) == logits.argmax(-1)).all()


def test_top_k_never_samples_outside_the_k_best():
    logits = np.array([[10.0, 9.0, 8.0, -5.0, -5.0, -5.0]])
    config = GenerationConfig(do_sample=True, top_k=2, temperature=5.0)
    rng = np.random.default_rng(0)
    seen = {int(choose(logits, config, rng)[0]) for _ in range(300)}
    assert seen == {0, 1}


def test_top_p_keeps_the_nucleus():
    # probabilities 0.5, 0.3, 0.2 (log): top_p 0.7 keeps the first two
    logits = np.log(np.array([[0.5, 0.3, 0.2]]))
    config = GenerationConfig(do_sample=True, top_p=0.7)
    rng = np.random.default_rng(0)
    counts = np.bincount([int(choose(logits, config, rng)[0]) for _ in range(2000)], minlength=3)
    assert counts[2] == 0 and counts[0] > counts[1] > 0
    assert abs(counts[0] / counts[:2].sum() - 0.5 / 0.8) < 0.05  # renormalized over the nucleus


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (GenerationConfig(max_new_tokens=0), "max_new_tokens"),
        (GenerationConfig(do_sample=True, temperature=0.0), "temperature"),
        (GenerationConfig(top_p=0.0), "top_p"),
        (GenerationConfig(top_k=-1), "top_k"),
    ],
)
def test_bad_config_is_a_clear_error(config, message):
    with pytest.raises(tfgraph.TfgraphError, match=message):
        config.check()


def test_sampling_is_reproducible_with_a_seed_and_varies_without(cached_gpt):
    decoder = CachedDecoder(Session(cached_gpt))
    config = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=1.5, seed=3)
    first = generate(decoder, [[1, 2, 3]], config).tokens
    assert generate(decoder, [[1, 2, 3]], config).tokens == first
    others = {
        tuple(
            generate(decoder, [[1, 2, 3]], GenerationConfig(**{**vars(config), "seed": s})).tokens[
                0
            ]
        )
        for s in range(4, 8)
    }
    assert len(others | {tuple(first[0])}) > 1


def test_eos_stops_each_row(cached_gpt):
    decoder = CachedDecoder(Session(cached_gpt))
    greedy = generate(decoder, [[1, 2, 3], [4, 5]], GenerationConfig(max_new_tokens=10)).tokens
    eos = greedy[0][2]  # row 0's third token
    stopped = generate(
        decoder, [[1, 2, 3], [4, 5]], GenerationConfig(max_new_tokens=10, eos_token_id=eos)
    ).tokens
    assert stopped[0] == greedy[0][: greedy[0].index(eos) + 1]
    row1 = greedy[1][: greedy[1].index(eos) + 1] if eos in greedy[1] else greedy[1]
    assert stopped[1] == row1


def test_uncached_artifact_is_refused(gpt_artifact):
    with pytest.raises(tfgraph.TfgraphError, match="--kv-cache"):
        CachedDecoder(Session(gpt_artifact.out_dir))


def test_generate_cli_prints_tokens(cached_gpt, capsys):
    code = main(
        [
            "generate",
            str(cached_gpt),
            "--input-ids",
            "1 2 3",
            "--input-ids",
            "4",
            "--max-new-tokens",
            "5",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    decoder = CachedDecoder(Session(cached_gpt))
    want = generate(decoder, [[1, 2, 3], [4]], GenerationConfig(max_new_tokens=5)).tokens
    assert out == [f"[{i}] {' '.join(map(str, row))}" for i, row in enumerate(want)]


def test_generate_cli_without_prompt_or_tokenizer(cached_gpt, capsys):
    assert main(["generate", str(cached_gpt)]) == 2
    assert "give a prompt" in capsys.readouterr().err
    assert main(["generate", str(cached_gpt), "--text", "hello"]) == 2
    assert "carries no tokenizer" in capsys.readouterr().err


def test_run_fills_an_empty_past(cached_gpt, capsys):
    assert main(["run", str(cached_gpt), "--input-ids", "1 2 3"]) == 0
    assert "logits" in capsys.readouterr().out


def test_generate_text_with_the_artifact_tokenizer(tmp_path, capsys):
    """An HF directory's tokenizer travels into the artifact; --text encodes and decodes."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    words = ["<pad>", "<unk>"] + [f"w{i}" for i in range(62)]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>")
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>"
    )
    hf_dir = tmp_path / "hf"
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(words))
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(hf_dir)
    fast.save_pretrained(hf_dir)
    out = tmp_path / "artifact"
    assert tfgraph.export(str(hf_dir), out, kv_cache=True).passed
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert main(["generate", str(out), "--text", "w1 w2 w3", "--max-new-tokens", "4"]) == 0
    line = capsys.readouterr().out.strip()
    decoder = CachedDecoder(Session(out))
    ids = fast("w1 w2 w3")["input_ids"]
    want = generate(decoder, [ids], GenerationConfig(max_new_tokens=4)).tokens[0]
    assert line == f"[0] {fast.decode(want)}"
    assert all(w in words for w in fast.decode(want).split())


def test_ort_cache_is_shared_buffers_appended_in_place(cached_gpt):
    """ort target: past and present are one preallocated buffer per layer; a step writes the
    new position in place (same memory, nothing copied) and the graph has no cache Concat."""
    import onnx

    model = onnx.load(cached_gpt / "model.onnx")
    inputs = {i.name for i in model.graph.input}
    assert "past_sequence_length" in inputs
    past_names = {n for n in inputs if n.startswith("past_key_values.")}
    assert not any(n.op_type == "Concat" and set(n.input) & past_names for n in model.graph.node)
    decoder = CachedDecoder(Session(cached_gpt))
    assert decoder.shared
    cache = decoder.empty_cache(1, capacity=6)
    name = next(iter(cache.values))
    before = cache.values[name].data_ptr()
    _, cache = decoder.step(np.array([[1, 2, 3]]), cache)
    _, cache = decoder.step(np.array([[4]]), cache)
    assert cache.length == 4 and cache.values[name].data_ptr() == before
    keys = cache.values[name].numpy()
    assert np.abs(keys[:, :, :4]).sum() > 0 and np.abs(keys[:, :, 4:]).sum() == 0
    with pytest.raises(tfgraph.TfgraphError, match="holds 6 positions but 7"):
        decoder.step(np.array([[1, 2, 3]]), cache)


def test_head_size_not_multiple_of_8_keeps_a_copying_cache(tmp_path):
    """GQA's CPU kernel refuses head size 2 (llama2-70b-tiny): MultiHeadAttention with a Concat
    cache, no shared buffers, and parity still holds."""
    result = tfgraph.export("llama2-70b-tiny", tmp_path / "a", kv_cache=True)
    assert result.passed
    decoder = CachedDecoder(Session(tmp_path / "a"))
    assert not decoder.shared


def test_stream_rows_with_their_own_limits_and_seeds_match_each_alone(cached_gpt):
    """A server's batch: each row its own max_new_tokens and seed; every row's tokens are the
    ones it gets alone (gpt-tiny takes an attention mask: the padded rows are masked)."""
    from tfgraph.runtime import stream

    decoder = CachedDecoder(Session(cached_gpt))
    prompts, limits, seeds = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], [5, 9, 2], [11, 12, 13]
    for sampled in (False, True):
        config = GenerationConfig(do_sample=sampled, temperature=1.5)
        rows = [[] for _ in prompts]
        steps = list(stream(decoder, prompts, config, limits=limits, seeds=seeds))
        assert len(steps) == max(limits)
        for step in steps:
            for row, token in step.tokens.items():
                rows[row].append(token)
        for prompt, limit, seed, got in zip(prompts, limits, seeds, rows, strict=True):
            alone = GenerationConfig(
                max_new_tokens=limit, do_sample=sampled, temperature=1.5, seed=seed
            )
            assert got == generate(decoder, [prompt], alone).tokens[0]
    with pytest.raises(TfgraphError, match="limits"):
        stream(decoder, prompts, limits=[1, 2])
