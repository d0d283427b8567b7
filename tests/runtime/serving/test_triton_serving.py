"""The generation model served by a real Triton Inference Server (``nvidia-pytriton``'s
``tritonserver`` from the server environment, ``python -m tfgraph.runtime.serving.install``; CPU,
Python backend on the server environment's numpy<2), over gRPC (tritonclient's streaming API,
in this process, whatever its NumPy) and HTTP (Triton's ``generate_stream`` endpoint:
tritonclient's HTTP client takes no decoupled models).

Streamed tokens are compared with local :func:`tfgraph.runtime.generate` on the same artifact,
token for token: greedy and seeded sampling, a decoder and an encoder-decoder, 16 concurrent
clients, bad requests, and an unload/reload with a stream in flight.
"""

import json
import queue
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

import tfgraph
from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner
from tfgraph.runtime.generate import seq2seq_prompts

# slow: five exports and a real server (~65 s of setup); the default tier keeps a real Triton
# server streaming the in-flight generation model token for token (test_triton_faults.py) and
# the printed command starting one (test_triton_command.py)
pytestmark = pytest.mark.slow

grpcclient = pytest.importorskip(
    "tritonclient.grpc", reason="needs tritonclient: pip install 'tfgraph[serve]'"
)
from tfgraph.errors import TfgraphError  # noqa: E402
from tfgraph.runtime.serving.launcher import TritonServer, find_tritonserver  # noqa: E402

try:
    find_tritonserver()
except TfgraphError as exc:
    pytest.skip(f"needs the Triton server environment: {exc}", allow_module_level=True)
from tfgraph.runtime.serving.repository import write_repository  # noqa: E402

DECODER, SEQ2SEQ, TEXT = "llama", "t5", "words"
SLOTS = "slots"  # llama-tiny in 2 cache slots (in-flight batching)
INT8 = "llama8"  # llama-tiny with an int8 KV cache, in flight
BART = "bart"  # an encoder-decoder in flight with learned positions (t5-tiny: a relative bias)
WORDS = ["[UNK]", "[PAD]", "the", "cat", "sat", "on", "a", "mat", "dog", "ran", "café"]


def _word_tokenizer_gpt2(path):
    """A random-init HF GPT-2 (64 positions) saved with a word-level tokenizer (no download)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(WORDS)}
    vocab.update({f"w{i}": i for i in range(len(WORDS), 64)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]"
    )
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    transformers.GPT2LMHeadModel(config).eval().save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    hf = _word_tokenizer_gpt2(root / "hf-words")
    sources = {DECODER: "llama-tiny", SEQ2SEQ: "t5-tiny", TEXT: str(hf)}
    repo = root / "repo"
    models = []
    for name, source in sources.items():
        assert tfgraph.export(source, root / name, kv_cache=True).passed
        part = root / f"repo-{name}"
        write_repository(root / name, part, name=name)
        models.append(f"{name}_generate")
        repo.mkdir(exist_ok=True)
        (part / f"{name}_generate").rename(repo / f"{name}_generate")
    write_repository(root / DECODER, root / "repo-slots", name=SLOTS, slots=2, slot_capacity=1600)
    (root / "repo-slots" / f"{SLOTS}_generate").rename(repo / f"{SLOTS}_generate")
    models.append(f"{SLOTS}_generate")
    assert tfgraph.export("llama-tiny", root / INT8, kv_cache=True, kv_dtype="int8").passed
    write_repository(root / INT8, root / "repo-int8", name=INT8, slots=4, slot_capacity=256)
    (root / "repo-int8" / f"{INT8}_generate").rename(repo / f"{INT8}_generate")
    models.append(f"{INT8}_generate")
    assert tfgraph.export("bart-tiny", root / BART, kv_cache=True).passed
    written = write_repository(root / BART, root / "repo-bart", name=BART, slots=2)
    assert any("in-flight" in note for m in written for note in m.notes)
    (root / "repo-bart" / f"{BART}_generate").rename(repo / f"{BART}_generate")
    models.append(f"{BART}_generate")
    with TritonServer(repo, load=models, startup_timeout=120) as server:
        yield server, root
    assert server.process.poll() is not None  # stopped at the end, always


def _local(root, name, prompt, **options):
    decoder = CachedDecoder(open_runner(root / name / "model.onnx"))
    prompts, extra = [prompt], {}
    if decoder.seq2seq:
        prompts, extra = seq2seq_prompts(decoder, prompts, 0, 0)
    config = GenerationConfig(**options)
    return generate(decoder, prompts, config, extra=extra).tokens[0]


def _grpc_stream(server, model, prompt=None, text=None, dtype=np.int64, started=None, **params):
    """(tokens, texts, error) of one streamed request over gRPC; ``started`` (an Event) is
    set at the first token."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    inputs = []
    if prompt is not None:
        array = np.asarray(prompt, dtype=dtype)
        tensor = grpcclient.InferInput("input_ids", list(array.shape), _triton_type(array))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    if text is not None:
        tensor = grpcclient.InferInput("text", [1], "BYTES")
        tensor.set_data_from_numpy(np.array([text], dtype=np.object_))
        inputs.append(tensor)
    params = {"stream": True, **params}  # a response per token
    client.async_stream_infer(model, inputs, parameters=params, enable_empty_final_response=True)
    tokens, texts, error = [], [], None
    while True:
        result, error = results.get(timeout=120)
        if error is not None:
            break
        response = result.get_response()
        if response.parameters.get("triton_final_response").bool_param:
            break
        tokens.append(int(result.as_numpy("token_id")[0]))
        if started is not None:
            started.set()
        if model.startswith(TEXT):
            texts.append(result.as_numpy("token_text")[0].decode())
    client.stop_stream()
    client.close()
    return tokens, texts, error


def _triton_type(array):
    return {np.int64: "INT64", np.float32: "FP32", np.int32: "INT32"}[array.dtype.type]


@pytest.mark.parametrize("name", [DECODER, SEQ2SEQ])
def test_streamed_tokens_equal_local_generate(served, name):
    server, root = served
    model = f"{name}_generate"
    for prompt in ([5, 17, 3, 9], [7], [30, 31, 32, 33, 34, 35]):
        want = _local(root, name, prompt, max_new_tokens=12)
        got, _, error = _grpc_stream(server, model, prompt, max_new_tokens=12)
        assert error is None and got == want and len(got) == 12
    # t5-tiny's random logits put nearly all mass on token 0: a hot temperature spreads it
    hot = 30.0 if name == SEQ2SEQ else 0.8
    sampled = {"max_new_tokens": 10, "temperature": hot, "top_k": 200, "top_p": 0.95}
    want = _local(root, name, [5, 17, 3], do_sample=True, seed=7, **sampled)
    got, _, error = _grpc_stream(server, model, [5, 17, 3], seed=7, **sampled)
    assert error is None and got == want
    other, _, _ = _grpc_stream(server, model, [5, 17, 3], seed=8, **sampled)
    assert other != got  # the seed matters


def test_http_generate_stream_and_text(served):
    """Triton's HTTP ``generate_stream`` (server-sent events) on the model with a tokenizer:
    text in, tokens and their text out."""
    server, root = served
    body = json.dumps({"text": "the cat sat on", "max_new_tokens": 6, "stream": True}).encode()
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{TEXT}_generate/generate_stream",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(request, timeout=60) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    tokens = [np.ravel(e["token_id"])[0] for e in events]
    want = _local(root, TEXT, [2, 3, 4, 5], max_new_tokens=6)  # the, cat, sat, on
    assert tokens == want
    assert all(isinstance(e["token_text"], (str, list)) for e in events)
    _, texts, error = _grpc_stream(server, f"{TEXT}_generate", text="the dog ran", max_new_tokens=4)
    assert error is None and len(texts) == 4


def _http_generate(server, model, body):
    """(status, JSON answer) of Triton's HTTP ``generate`` endpoint (one response)."""
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/models/{model}/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_generate_answers_whole_and_errors_with_their_status(served):
    """Without ``stream`` the model answers in one response, so Triton's HTTP ``generate``
    (which takes exactly one) gives 200 with every token and their text; a bad request gets
    400 with the error (before: 200 with Triton's "exactly 1 response" error)."""
    server, root = served
    model = f"{TEXT}_generate"
    code, answer = _http_generate(server, model, {"text": "the cat sat on", "max_new_tokens": 6})
    want = _local(root, TEXT, [2, 3, 4, 5], max_new_tokens=6)
    assert code == 200, answer
    assert [int(t) for t in np.ravel(answer["token_id"])] == want
    text = answer["token_text"]
    words = [WORDS[t] if t < len(WORDS) else f"w{t}" for t in want]
    assert (text if isinstance(text, str) else text[0]) == " ".join(words)
    for body, needle in [
        ({"text": "the cat", "beam_width": 4}, "unknown parameter"),
        ({"input_ids": [], "max_new_tokens": 2}, "prompt is empty"),
        ({"text": "the cat", "max_new_tokens": 500}, "positions"),
    ]:
        code, answer = _http_generate(server, model, body)
        assert code == 400 and needle in answer["error"], (code, answer)


@pytest.mark.parametrize("name", [DECODER, TEXT])  # TEXT has an attention mask: padded batches
def test_sixteen_concurrent_streams_get_their_own_tokens(served, name):
    """Arriving together, the requests are decoded in batches (equal prompt lengths only for
    llama-tiny, which has no attention mask); each stream still gets its own tokens."""
    server, root = served
    prompts = [[(7 * i + j) % 60 + 1 for j in range(1 + i % 5)] for i in range(16)]
    want = [_local(root, name, p, max_new_tokens=10 + i % 3) for i, p in enumerate(prompts)]
    got = [None] * 16

    def client(i):
        got[i] = _grpc_stream(server, f"{name}_generate", prompts[i], max_new_tokens=10 + i % 3)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for i in range(16):
        tokens, _, error = got[i]
        assert error is None, error
        assert tokens == want[i], i


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"prompt": [1.0, 2.0], "dtype": np.float32}, "input_ids"),  # wrong dtype
        ({"prompt": [[1, 2]]}, "input_ids"),  # wrong rank
        ({"prompt": []}, "prompt is empty"),
        ({"prompt": [1, 2], "max_new_tokens": 500}, "positions"),  # beyond the cache
        ({"prompt": [1, 2], "beam_width": 4}, "unknown parameter"),
        ({"prompt": [1, 2], "top_k": "many"}, "top_k must be an integer"),
        ({"text": b"\xff\xfe cat"}, "not valid UTF-8"),
        ({"prompt": [1, 2], "text": "the cat"}, "exactly one prompt"),
    ],
)
def test_bad_requests_get_an_error_and_the_server_goes_on(served, kwargs, needle):
    server, root = served
    tokens, _, error = _grpc_stream(server, f"{TEXT}_generate", **kwargs)
    assert error is not None and tokens == []
    assert needle in str(error), str(error)
    good, _, error = _grpc_stream(server, f"{TEXT}_generate", [2, 3], max_new_tokens=3)
    assert error is None and good == _local(root, TEXT, [2, 3], max_new_tokens=3)


def test_unload_with_a_stream_in_flight_then_reload(served):
    server, root = served
    model = f"{DECODER}_generate"
    outcome = {}

    started = threading.Event()

    def long_stream():
        outcome["result"] = _grpc_stream(
            server, model, [5, 6, 7], started=started, max_new_tokens=400
        )

    thread = threading.Thread(target=long_stream)
    thread.start()
    try:
        assert started.wait(timeout=60)  # the stream is in flight
        server.unload(model)
    finally:
        thread.join(timeout=180)
    tokens, _, error = outcome["result"]
    want = _local(root, DECODER, [5, 6, 7], max_new_tokens=400)
    if error is None:  # completed
        assert tokens == want
    else:  # or failed cleanly, its tokens so far correct
        assert "unloaded" in str(error) or "unavailable" in str(error).lower(), str(error)
        assert tokens == want[: len(tokens)]
    assert not server.is_model_ready(model)
    server.load(model)
    assert server.is_model_ready(model)
    again, _, error = _grpc_stream(server, model, [5, 6, 7], max_new_tokens=5)
    assert error is None and again == want[:5]


def test_inflight_a_short_request_joins_and_ends_before_a_long_one(served):
    """In-flight batching: a request arriving while a long stream runs takes the free slot
    at the next step and ends long before it (static batching would make it wait for the
    long one); both streams equal generate alone."""
    server, root = served
    model = f"{SLOTS}_generate"
    started, finished, results = threading.Event(), {}, {}

    def stream(key, prompt, n, event=None):
        results[key] = _grpc_stream(server, model, prompt, started=event, max_new_tokens=n)
        finished[key] = len(finished)

    # long enough that the short request, sent after its first token, arrives mid-stream even
    # with the other test worker loading the CPU (500 tokens were not, twice, in one session)
    long = threading.Thread(target=stream, args=("long", [5, 6, 7], 1500, started))
    long.start()
    assert started.wait(timeout=60)
    stream("short", [9, 3], 4)  # arrives mid-stream, in this thread
    long.join(timeout=180)
    assert finished == {"short": 0, "long": 1}
    for key, prompt, n in (("long", [5, 6, 7], 1500), ("short", [9, 3], 4)):
        tokens, _, error = results[key]
        assert error is None and tokens == _local(root, DECODER, prompt, max_new_tokens=n)


def test_inflight_more_clients_than_slots_and_a_request_too_long_for_a_slot(served):
    server, root = served
    model = f"{SLOTS}_generate"
    prompts = [[(5 * i + j) % 60 + 1 for j in range(1 + i % 4)] for i in range(6)]
    got = [None] * 6

    def client(i):
        got[i] = _grpc_stream(server, model, prompts[i], max_new_tokens=8 + i)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    for i in range(6):  # 6 requests through 2 slots: they waited, joined and freed them
        tokens, _, error = got[i]
        assert error is None and tokens == _local(root, DECODER, prompts[i], max_new_tokens=8 + i)
    tokens, _, error = _grpc_stream(server, model, [1, 2, 3], max_new_tokens=1600)
    assert tokens == [] and "a slot holds 1600" in str(error), str(error)


def _streams_equal_local(served, name, prompts, new_tokens):
    """Every prompt streamed at once (a thread each) equals local generate on it alone."""
    server, root = served
    got = [None] * len(prompts)

    def client(i):
        got[i] = _grpc_stream(server, f"{name}_generate", prompts[i], max_new_tokens=new_tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for prompt, (tokens, _, error) in zip(prompts, got, strict=True):
        assert error is None and tokens == _local(root, name, prompt, max_new_tokens=new_tokens)


def test_an_int8_cache_streams_what_generate_gives_locally(served):
    """The generation model allocates its slots in the dtype the graph takes (int8 here)."""
    _streams_equal_local(served, INT8, [[5, 6, 7], [9, 3, 2, 8, 1], [4]], 12)


def test_an_encoder_decoder_in_flight_streams_what_generate_gives_locally(served):
    """bart-tiny's slots hold each request's cross K/V: 4 requests through 2 slots."""
    _streams_equal_local(served, BART, [[5, 6, 7, 8], [9, 3], [4, 4, 4, 4, 4, 4], [11]], 8)
