"""``tfgraph serve``: the OpenAI API over the in-flight batcher, driven by the official
``openai`` client on 127.0.0.1.

A random-init Hugging Face Llama with a word-level tokenizer and a chat template (no download)
is exported with its KV cache; the server (uvicorn in a thread here, the CLI in a subprocess in
the last test) answers completions and chat, whole and streamed, with the tokens
:func:`tfgraph.runtime.generate` gives the same prompt alone; 16 concurrent streams all
complete with their own tokens, batched in flight; malformed requests get a 4xx JSON error.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest
import torch
from child_signals import terminal_signals

import tfgraph
from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner

openai = pytest.importorskip("openai", reason="the test client: pip install -e '.[dev]'")
pytest.importorskip("fastapi", reason="tfgraph serve: pip install 'tfgraph[serve]'")
pytest.importorskip("uvicorn", reason="tfgraph serve: pip install 'tfgraph[serve]'")
transformers = pytest.importorskip("transformers")

from tfgraph.runtime.serving.openai_app import (  # noqa: E402
    bound_socket,
    create_app,
    open_engine,
    server,
)
from tfgraph.runtime.serving.openai_text import RequestError, chat_prompt  # noqa: E402

EOS = 2
NAME = "tiny-llama"
ROLES = ["system", "user", "assistant"]
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant{% endif %}"
)


def _tiny_llama(path):
    """A random-init Llama (2 layers, 256 positions) with a word-level tokenizer whose
    ``chat_template`` renders each message as ``<s>role content</s>``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>", *ROLES] + [f"w{i}" for i in range(250)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="</s>",
    )  # fmt: skip
    fast.chat_template = TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=EOS,
    )  # fmt: skip
    torch.manual_seed(0)  # the same model however many tests ran before in this process
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    hf = _tiny_llama(root / "hf")
    out = root / "artifact"
    assert tfgraph.export(str(hf), out, kv_cache=True).passed
    return out


@pytest.fixture(scope="module")
def served(artifact):
    """The app on a free port of 127.0.0.1, uvicorn in a thread; the openai client."""
    engine, tokenizer = open_engine(artifact, slots=16, capacity=128)
    sock = bound_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    uv = server(create_app(engine, tokenizer, NAME))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uv.started
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    decoder = CachedDecoder(open_runner(artifact / "model.onnx"))
    yield SimpleNamespace(url=url, client=client, engine=engine, tok=tokenizer, decoder=decoder)
    uv.should_exit = True
    thread.join(timeout=30)
    engine.close()
    sock.close()
    assert not thread.is_alive()


def _reference(served, prompt, n, **sampling):
    """``generate``'s tokens for ``prompt`` alone, and their text."""
    config = GenerationConfig(max_new_tokens=n, eos_token_id=EOS, **sampling)
    tokens = generate(served.decoder, [prompt], config).tokens[0]
    return tokens, served.tok.decode(tokens, skip_special_tokens=True)


def _reason(tokens):
    return "stop" if tokens[-1] == EOS else "length"


IDS = {"return_token_ids": True}


def test_models_lists_the_artifact(served):
    models = served.client.models.list().data
    assert [m.id for m in models] == [NAME]
    assert models[0].model_extra["max_model_len"] == 128


def test_completions_whole_and_streamed_equal_generate(served):
    prompt = "w5 w17 w3 w99"
    ids = served.tok(prompt)["input_ids"]
    tokens, text = _reference(served, ids, 12)
    out = served.client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body=IDS
    )
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == tokens and choice.text == text
    assert choice.finish_reason == _reason(tokens)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), len(tokens))
    chunks = list(
        served.client.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IDS,
        )
    )
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in pieces) == text
    assert [t for p in pieces for t in p.model_extra["token_ids"]] == tokens
    assert pieces[-1].finish_reason == _reason(tokens)
    assert chunks[-1].usage.completion_tokens == len(tokens)
    by_ids = served.client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == text


def test_chat_whole_and_streamed_equal_generate(served):
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w40 w41"}]
    rendered = served.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = served.tok(rendered, add_special_tokens=False)["input_ids"]
    assert ids[:3] == served.tok.convert_tokens_to_ids(["<s>", "system", "w1"])  # templated
    tokens, text = _reference(served, ids, 10)
    out = served.client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, extra_body=IDS
    )
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.model_extra["token_ids"] == tokens
    assert out.usage.prompt_tokens == len(ids) and choice.finish_reason == _reason(tokens)
    stream = served.client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = [c.choices[0] for c in stream]
    assert chunks[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for c in chunks) == text
    assert chunks[-1].finish_reason == _reason(tokens)


def test_seeded_sampling_and_a_stop_string(served):
    ids = served.tok("w9 w8 w7")["input_ids"]
    sampling = {"temperature": 0.8, "top_p": 0.9}
    tokens, text = _reference(served, ids, 8, do_sample=True, seed=7, **sampling)
    out = served.client.completions.create(
        model=NAME, prompt="w9 w8 w7", max_tokens=8, seed=7, extra_body=IDS, **sampling
    )
    assert out.choices[0].model_extra["token_ids"] == tokens
    greedy, text = _reference(served, ids, 8)
    words = text.split()
    assert words
    stop = words[min(3, len(words) - 1)]  # its first occurrence ends the text
    for stream in (False, True):
        out = served.client.completions.create(
            model=NAME, prompt="w9 w8 w7", max_tokens=8, temperature=0, stop=[stop], stream=stream
        )
        chunks = list(out) if stream else [out]
        got = "".join(c.choices[0].text for c in chunks)
        assert got == text[: text.index(stop)], got
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_sixteen_concurrent_streams_all_complete_batched_in_flight(served, monkeypatch):
    """Each step slowed by 10 ms (a request lasts 0.4 s or more, longer than the clients take
    to arrive on a loaded machine): they share the steps, each with its own tokens."""
    prompts = [[10 + i + j for j in range(1 + i % 5)] for i in range(16)]
    limits = [40 + i % 7 for i in range(16)]
    results = [None] * 16
    step = served.engine.batcher.step

    def slow_step():
        time.sleep(0.01)
        return step()

    monkeypatch.setattr(served.engine.batcher, "step", slow_step)
    served.engine.peak_active = 0

    def client(i):
        stream = served.client.completions.create(
            model=NAME, prompt=prompts[i], max_tokens=limits[i], temperature=0, stream=True,
            extra_body=IDS,
        )  # fmt: skip
        chunks = [c.choices[0] for c in stream]
        results[i] = ([t for c in chunks for t in c.model_extra["token_ids"]], chunks[-1])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i in range(16):
        assert results[i] is not None, f"stream {i} did not complete"
        tokens, last = results[i]
        want, _ = _reference(served, prompts[i], limits[i])
        assert tokens == want, i
        assert last.finish_reason == _reason(want)
    assert served.engine.peak_active >= 8  # they ran in one batch, not one after another
    assert not served.engine.batcher.active and not served.engine.pending


def test_a_client_that_leaves_mid_stream_frees_its_slot(served, monkeypatch):
    """The client reads two chunks and closes the connection. Once the request has its two
    tokens, each step waits until the client has left and then until the server has cancelled
    the job (up to 30 s each), so however loaded the machine, the request cannot end on its own
    first: it leaves its slot as cancelled, not finished."""
    step, submit = served.engine.batcher.step, served.engine.submit
    left, jobs = threading.Event(), []

    def held_step():
        time.sleep(0.01)
        request = jobs[0].request if jobs else None
        if request is not None and len(request.tokens) >= 2:  # the client can read two
            left.wait(30)
            jobs[0].cancelled.wait(30)
        return step()

    def recording_submit(*args, **kwargs):
        jobs.append(submit(*args, **kwargs))
        return jobs[-1]

    # the request's first tokens are words (a chunk each) and it does not end early: else
    # the client's two chunks would need more tokens than the hold lets through
    prompt = served.tok("w1 w2")["input_ids"]
    want, _ = _reference(served, prompt, 120)
    assert len(want) == 120 and all(served.tok.decode([t]).strip() for t in want[:2]), want[:8]
    monkeypatch.setattr(served.engine.batcher, "step", held_step)
    monkeypatch.setattr(served.engine, "submit", recording_submit)
    before = dict(served.engine.ended)
    stream = served.client.completions.create(
        model=NAME, prompt="w1 w2", max_tokens=120, temperature=0, stream=True
    )
    for _, _ in zip(range(2), stream, strict=False):
        pass
    left.set()
    stream.close()
    deadline = time.monotonic() + 30
    while served.engine.ended["cancelled"] == before.get("cancelled", 0):
        assert time.monotonic() < deadline, "the server did not notice the client leaving"
        time.sleep(0.02)
    assert served.engine.ended["finished"] == before.get("finished", 0)
    assert not served.engine.batcher.active


def _post(url, body, path="/v1/completions"):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize(
    "body, status, needle",
    [
        (b"{not json", 400, "not valid JSON"),
        ({"model": NAME}, 400, "'prompt' is required"),
        ({"prompt": "w1", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "w1", "temperature": 3}, 400, "temperature"),
        ({"prompt": "w1", "n": 2}, 400, "n"),
        ({"prompt": "w1", "logprobs": 2}, 400, "logprobs"),
        ({"prompt": "w1", "best_fruit": "kiwi"}, 400, "unsupported field 'best_fruit'"),
        ({"prompt": "w1", "max_tokens": 500}, 400, "slot holds 128"),
        ({"prompt": [1, 999]}, 400, "vocabulary"),
        ({"prompt": ""}, 400, "empty"),
        ({"prompt": "w1", "model": "gpt-4"}, 404, "does not exist"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "robot", "content": "w1"}]}, 400, "role"),
    ],
)
def test_malformed_requests_get_a_4xx_json_error(served, body, status, needle):
    path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else None
    code, answer = _post(served.url, body, path or "/v1/completions")
    assert code == status, answer
    assert needle in answer["error"]["message"], answer
    assert answer["error"]["type"] in ("invalid_request_error", "not_found_error")


def test_the_openai_client_raises_on_4xx_and_unknown_paths_are_json(served):
    with pytest.raises(openai.BadRequestError, match="slot holds 128"):
        served.client.completions.create(model=NAME, prompt="w1", max_tokens=1000)
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="other", prompt="w1")
    code, answer = _post(served.url, {}, "/v1/embeddings")
    assert code == 404 and "error" in answer
    ok = served.client.completions.create(model=NAME, prompt="w1", max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")  # served on after the errors


def test_a_tokenizer_without_a_chat_template_is_a_400(served):
    plain = SimpleNamespace(chat_template=None)
    with pytest.raises(RequestError, match="no chat template") as info:
        chat_prompt(plain, [{"role": "user", "content": "w1"}])
    assert info.value.status == 400


# slow: a second process importing tfgraph, ONNX Runtime and transformers (~13 s on 2 shared
# cores); the app it runs is the one the tests above drive in this process
@pytest.mark.slow
def test_the_cli_serves_and_stops_on_ctrl_c(artifact, tmp_path):
    """``tfgraph serve DIR --port P`` in a process of its own: one completion, then SIGINT."""
    port = bound_socket("127.0.0.1", 0)
    number = port.getsockname()[1]
    port.close()
    cmd = [sys.executable, "-m", "tfgraph", "serve", str(artifact), "--port", str(number)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=env, preexec_fn=terminal_signals)  # fmt: skip
    try:
        line = process.stdout.readline()
        assert line.startswith(f"serving '{artifact.name}' on http://127.0.0.1:{number}/v1"), line
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{number}/v1", api_key="x")
        out = client.completions.create(model=artifact.name, prompt="w3", max_tokens=3)
        assert out.usage.completion_tokens >= 1
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 130, err
    assert "Traceback" not in err, err
