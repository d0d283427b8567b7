"""Serving a vision-language artifact: the in-flight batcher with per-request image features,
``tfgraph serve``'s chat with an image content part (the official ``openai`` client), and the
Triton generation model's ``image`` input (tritonclient), each giving the greedy tokens of
``tfgraph.load(DIR).generate(text, image=…)`` and of Hugging Face's ``generate`` on the tiny
random LLaVA (tfgraph/tools/tiny_vlm_build.py), exported once for the module.

The default tier checks the request side alone (image parts parsed, remote URLs and unreadable
images refused in one line); the export and everything served from it are slow-tier.
"""

import base64
import io
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

import tfgraph
from tests.grpc_streams import stream_tokens
from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner
from tfgraph.runtime.inflight import generate_inflight

openai = pytest.importorskip("openai", reason="the test client: pip install -e '.[dev]'")
pytest.importorskip("fastapi", reason="tfgraph serve: pip install 'tfgraph[serve]'")
pytest.importorskip("uvicorn", reason="tfgraph serve: pip install 'tfgraph[serve]'")

from tfgraph.runtime.serving.openai_app import (  # noqa: E402
    bound_socket,
    create_app,
    image_prompt,
    open_engine,
    server,
)
from tfgraph.runtime.serving.openai_protocol import ChatRequest  # noqa: E402
from tfgraph.runtime.serving.openai_text import RequestError, decode_image  # noqa: E402

NAME, NEW = "tiny-llava", 8
TEXT = "w1 w2 w3"  # after the image token: the tiny family's prompt, "<image> w1 w2 w3"
# the processor's chat template: an image part writes the image token, a text part its text
TEMPLATE = (
    "{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image> "
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}"
)


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: the server sees these very pixels
    return buffer.getvalue()


def _data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


def _chat(image, text=TEXT) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": _data_url(image)}}]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


# --- the request side (default tier) --------------------------------------------------------


def test_image_parts_parse_and_bad_images_are_refused_in_one_line():
    from tfgraph.tools.tiny_vlm_build import random_image

    image = random_image(0)
    request = ChatRequest(messages=_chat(image), max_tokens=4)
    message = request.messages[0]
    assert message.images == [_data_url(image)]
    assert message.as_processor_input()["content"] == [
        {"type": "image"},
        {"type": "text", "text": TEXT},
    ]
    assert message.as_template_input() == {"role": "user", "content": TEXT}
    decoded = decode_image(_data_url(image))
    assert np.array_equal(np.asarray(decoded), np.asarray(image))
    for url, needle in [
        ("https://example.com/cat.png", "remote URLs are not fetched"),
        ("file:///etc/passwd", "give a data URL"),
        ("data:image/png;base64,!!!", "not a readable base64 image"),
        ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "not a readable"),
    ]:
        with pytest.raises(RequestError, match=needle) as caught:
            decode_image(url)
        assert "\n" not in str(caught.value)
    text_only = SimpleNamespace(images=None)  # an engine over a text decoder
    with pytest.raises(RequestError, match="takes no images"):
        image_prompt(text_only, request.messages)


def _step_manifest(*roles) -> dict:
    """A decoder step graph's manifest entry (the tiny LLaVA's, written out) with ``roles``'
    inputs besides the tokens, the mask and the cache."""
    port = lambda name, role, shape, dtype="int64": {  # noqa: E731
        "name": name, "role": role, "shape": shape, "dtype": dtype}  # fmt: skip
    cache = ["batch", 4, "max_sequence", 16]
    inputs = [
        port("input_ids", "token_ids", ["batch", "sequence"]),
        port("attention_mask", "attention_mask", ["batch", "total_sequence"]),
        *[
            port(r, r, ["batch", "image_tokens", 64] if "features" in r else ["batch", 1])
            for r in roles
        ],
        port("past_key_values.0.key", "past_key", cache, "float"),
        port("past_key_values.0.value", "past_value", cache, "float"),
        port("past_sequence_length", "past_length", [1]),
        port("past_sequence_lengths", "past_lengths", ["batch"]),
    ]
    kv = {"kind": "shared", "layers": 1, "row_lengths": "past_sequence_lengths"}
    logits = port("logits", "logits", ["batch", "sequence", 512], "float")
    return {"graphs": {"model.onnx": {"inputs": inputs, "outputs": [logits], "kv_layout": kv}}}


def test_the_batcher_takes_a_prompts_own_inputs_and_refuses_others():
    """Per-prompt inputs (:data:`contract.PROMPT_ROLES`) batch in flight; any other input a
    step graph takes per request is refused in one line. A request without an image gets
    (rows, 0, hidden) features and a delta of 0; an input without such a default is each
    request's own."""
    from tfgraph import contract
    from tfgraph.runtime.inflight import empty_prompt_input, signature_support

    def why(*roles):
        return signature_support(contract.signature_from_manifest(_step_manifest(*roles)), False)

    assert why("image_features") is None and why("image_features", "rope_deltas") is None
    assert why("image_features", "segment_ids") == (
        "the step graph also takes segment_ids per request"
    )
    signature = contract.signature_from_manifest(_step_manifest("image_features", "rope_deltas"))
    features, deltas = (signature.input(r) for r in (contract.IMAGE_FEATURES, "rope_deltas"))
    assert empty_prompt_input(features, 3).shape == (3, 0, 64)
    assert empty_prompt_input(deltas, 2).tolist() == [[0], [0]]
    tiles = contract.signature_from_manifest(_step_manifest("image_tiles")).input("image_tiles")
    with pytest.raises(tfgraph.TfgraphError, match="each request's 'image_tiles'"):
        empty_prompt_input(tiles, 1)


# --- served (slow tier) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """The tiny LLaVA (its processor with a chat template), Hugging Face's greedy tokens on
    its random image, and its artifact."""
    from tfgraph.tools.tiny_vlm_build import IMAGE_HW, build_family, eager_generate
    from tfgraph.tools.tiny_vlm_families import spec_for

    root = tmp_path_factory.mktemp("vlm")
    spec = spec_for("llava")
    model, processor = build_family("llava", root / "hf", spec)
    processor.chat_template = TEMPLATE
    processor.save_pretrained(root / "hf")
    _, want = eager_generate(model, processor, spec, new_tokens=NEW)
    assert processor.tokenizer.eos_token_id not in want  # HF ran past EOS: no early stop here
    out = root / "artifact"
    assert tfgraph.export(str(root / "hf"), out, kv_cache=True, image_size=IMAGE_HW).passed
    return SimpleNamespace(root=root, out=out, hf_tokens=want, processor=processor)


def _alone(vlm, text, image):
    """``tfgraph.load``'s path for one prompt: its processor, vision graph and ``generate``."""
    from tfgraph.runtime.vision_language import ImagePrompts

    out = vlm.out if hasattr(vlm, "out") else vlm
    ids, extra = ImagePrompts(out).prepare([text], [image] if image is not None else None)
    decoder = CachedDecoder(open_runner(out))
    tokens = generate(decoder, ids, GenerationConfig(max_new_tokens=NEW), extra=extra).tokens[0]
    return ids[0], extra, tokens


# slow: the tiny LLaVA's export with parity (~15 s on 2 shared cores), once for the module
@pytest.mark.slow
def test_inflight_requests_with_images_equal_generate_alone(vlm):
    """Two image prompts and a text prompt through 2 slots, arriving apart: each request's
    features are merged at its own prefill; its tokens equal generate alone (and HF's)."""
    from tfgraph.tools.tiny_vlm_build import random_image

    rows = [
        _alone(vlm, f"<image> {TEXT}", random_image(0)),
        _alone(vlm, "w5 w6", None),
        _alone(vlm, "<image> w9", random_image(1)),
    ]
    assert rows[0][2] == vlm.hf_tokens
    decoder = CachedDecoder(open_runner(vlm.out))
    done = generate_inflight(
        decoder,
        [r[0] for r in rows],
        GenerationConfig(max_new_tokens=NEW),
        extras=[r[1] for r in rows],
        arrivals=[0, 1, 2],
        slots=2,
    )
    assert [r.tokens for r in done] == [r[2] for r in rows]


# slow: a tiny Qwen2-VL's export with parity (~30 s on 2 shared cores)
@pytest.mark.slow
def test_inflight_mrope_deltas_stay_with_their_slot(tmp_path_factory):
    """Qwen2-VL (M-RoPE): an image prompt's ``rope_deltas`` go with its slot at every step,
    a text prompt's are 0; in flight equals generate alone, and alone equals HF's."""
    from tfgraph.tools.tiny_vlm_build import (
        IMAGE_HW,
        build_family,
        eager_generate,
        prompt_for,
        random_image,
    )
    from tfgraph.tools.tiny_vlm_families import spec_for

    root = tmp_path_factory.mktemp("qwen2_vl")
    spec = spec_for("qwen2_vl")
    model, processor = build_family("qwen2_vl", root / "hf", spec)
    _, want = eager_generate(model, processor, spec, new_tokens=NEW)
    out = root / "artifact"
    assert tfgraph.export(str(root / "hf"), out, kv_cache=True, image_size=IMAGE_HW).passed
    prompt = prompt_for(processor, spec)
    rows = [
        _alone(out, prompt, random_image(0)),
        _alone(out, "w5 w6", None),
        _alone(out, prompt, random_image(1)),
    ]
    assert rows[0][2] == want and rows[0][1]["rope_deltas"][0, 0] != 0
    done = generate_inflight(
        CachedDecoder(open_runner(out)),
        [r[0] for r in rows],
        GenerationConfig(max_new_tokens=NEW),
        extras=[r[1] for r in rows],
        arrivals=[0, 1, 2],
        slots=2,
    )
    assert [r.tokens for r in done] == [r[2] for r in rows]


@pytest.fixture(scope="module")
def served(vlm):
    """``tfgraph serve``'s app over the artifact on a free port, uvicorn in a thread."""
    engine, tokenizer = open_engine(vlm.out, slots=4, capacity=64)
    sock = bound_socket("127.0.0.1", 0)
    uv = server(create_app(engine, tokenizer, NAME))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uv.started
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    uv.should_exit = True
    thread.join(timeout=30)
    engine.close()
    sock.close()


@pytest.mark.slow  # slow: the export above
def test_serve_chat_with_an_image_equals_load_generate_and_hugging_face(vlm, served):
    from tfgraph.tools.tiny_vlm_build import random_image

    image = random_image(0)
    want = tfgraph.load(vlm.out).generate(f"<image> {TEXT}", max_new_tokens=NEW, image=image)
    ids = {"return_token_ids": True}
    out = served.chat.completions.create(
        model=NAME, messages=_chat(image), max_tokens=NEW, temperature=0, extra_body=ids
    )
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == vlm.hf_tokens
    assert choice.message.content == want and choice.finish_reason == "length"
    stream = served.chat.completions.create(
        model=NAME, messages=_chat(image), max_tokens=NEW, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    # concurrent requests, two images and a text prompt, batched in flight
    expected = [
        _alone(vlm, f"<image> {TEXT}", random_image(0))[2],
        _alone(vlm, "<image> w9", random_image(1))[2],
        _alone(vlm, "w5 w6", None)[2],
    ]
    got = [None] * 3

    def ask(i):
        if i == 2:
            answer = served.completions.create(
                model=NAME, prompt="w5 w6", max_tokens=NEW, temperature=0, extra_body=ids
            )
        else:
            messages = _chat(random_image(i), TEXT if i == 0 else "w9")
            answer = served.chat.completions.create(
                model=NAME, messages=messages, max_tokens=NEW, temperature=0, extra_body=ids
            )
        got[i] = answer.choices[0].model_extra["token_ids"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert got == expected


@pytest.mark.slow  # slow: the export above
def test_serve_refuses_a_remote_image_and_a_second_image(served):
    from tfgraph.tools.tiny_vlm_build import random_image

    remote = [{"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}]
    with pytest.raises(openai.BadRequestError, match="remote URLs are not fetched"):
        served.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": remote}], max_tokens=2
        )
    two = _chat(random_image(0)) + _chat(random_image(1))
    with pytest.raises(openai.BadRequestError, match="one image per request"):
        served.chat.completions.create(model=NAME, messages=two, max_tokens=2)


def _triton_stream(server, model, text, image=None, **params):
    inputs = {"text": np.array([text], dtype=np.object_)}
    if image is not None:
        inputs["image"] = np.array([image], dtype=np.object_)
    return stream_tokens(server, model, inputs, **params)


# slow: the export above, and a Triton server starting the Python backend (~20 s)
@pytest.mark.slow
def test_triton_generation_model_takes_an_image(vlm, tmp_path):
    pytest.importorskip("tritonclient.grpc", reason="needs tritonclient: 'tfgraph[serve]'")
    from tfgraph.errors import TfgraphError
    from tfgraph.runtime.serving.launcher import TritonServer, find_tritonserver
    from tfgraph.runtime.serving.repository import write_repository
    from tfgraph.tools.tiny_vlm_build import random_image

    try:
        find_tritonserver()
    except TfgraphError as exc:
        pytest.skip(f"needs the Triton server environment: {exc}")
    written = write_repository(vlm.out, tmp_path / "repo", name="llava", slots=2)
    assert [m.name for m in written] == ["llava_generate"]
    assert any("in-flight" in note for note in written[0].notes)
    static = write_repository(vlm.out, tmp_path / "part", name="static", batching="static")
    (tmp_path / "part" / "static_generate").rename(tmp_path / "repo" / "static_generate")
    models = ["llava_generate", "static_generate"]
    other_want = _alone(vlm, "<image> w9", random_image(1))[2]
    text_want = _alone(vlm, "w5 w6", None)[2]
    with TritonServer(tmp_path / "repo", load=models, startup_timeout=120) as triton:
        for model in models:  # in flight, and static (an image request: a batch of its own)
            tokens, error = _triton_stream(
                triton, model, f"<image> {TEXT}", _png(random_image(0)), max_new_tokens=NEW
            )
            assert error is None and tokens == vlm.hf_tokens, (model, error)
            other, error = _triton_stream(
                triton, model, "<image> w9", _png(random_image(1)), max_new_tokens=NEW
            )
            assert error is None and other == other_want
            text, error = _triton_stream(triton, model, "w5 w6", max_new_tokens=NEW)
            assert error is None and text == text_want, (model, error)
        _, error = _triton_stream(triton, models[0], TEXT, b"not an image", max_new_tokens=2)
        assert error is not None and "cannot read the image" in str(error)
    assert "arrive together" in static[0].notes[1]  # static batching
