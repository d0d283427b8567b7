"""The in-flight generation model under faults, against the real Triton server (the wheel's
``tritonserver``, CPU, metrics on): clients that disconnect mid-stream free their slots (the
model's ``tfgraph_requests_ended_total{reason=cancelled}`` counts them; none runs on to its
end), a stream of requests of random lengths with bad requests mixed in (each bad one gets
its error, each good one exactly its local ``generate`` tokens, no slot left held), and the
model process's resident memory flat after warm-up.

The default tier runs it short (48 requests); the slow tier at full size (200 requests)."""

import queue
import threading
import time

import numpy as np
import pytest

import tfgraph
from tests.grpc_streams import stream_tokens
from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner

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

NAME, SLOTS, CAPACITY = "faults", 4, 4096
MODEL = f"{NAME}_generate"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    assert tfgraph.export("llama-tiny", root / "llama", kv_cache=True).passed
    write_repository(root / "llama", root / "repo", name=NAME, slots=SLOTS, slot_capacity=CAPACITY)
    with TritonServer(root / "repo", load=[MODEL], startup_timeout=120, metrics=True) as server:
        yield server, CachedDecoder(open_runner(root / "llama" / "model.onnx"))


def _metric(server, name: str, **labels) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in {"model": MODEL, **labels}.items())
    values = server.metrics()
    key = next((k for k in values if k.startswith(name + "{") and _same(k, want)), None)
    assert key is not None, f"{name} {want} not in the server's metrics"
    return values[key]


def _same(key: str, labels: str) -> bool:
    return sorted(key[key.index("{") + 1 : -1].split(",")) == sorted(labels.split(","))


def _wait_for(predicate, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _stream(server, prompt, **params):
    """(tokens, error) of one streamed request."""
    return stream_tokens(server, MODEL, {"input_ids": np.asarray(prompt, dtype=np.int64)}, **params)


def test_clients_that_disconnect_mid_stream_free_their_slots(served):
    server, decoder = served
    before = {r: _metric(server, "tfgraph_requests_ended_total", reason=r)
              for r in ("finished", "cancelled", "unreachable")}  # fmt: skip
    gone = 3

    def leave_early(i):
        client = grpcclient.InferenceServerClient(server.grpc_url)
        got = queue.Queue()
        client.start_stream(callback=lambda result, error: got.put(error))
        tensor = grpcclient.InferInput("input_ids", [3], "INT64")
        tensor.set_data_from_numpy(np.array([i + 1, 2, 3], np.int64))
        # thousands of tokens: it would hold its slot for seconds if nobody noticed
        client.async_stream_infer(
            MODEL, [tensor], parameters={"max_new_tokens": CAPACITY - 8, "stream": True},
            enable_empty_final_response=True,
        )  # fmt: skip
        for _ in range(3):  # a few tokens, then the client goes away mid-stream
            assert got.get(timeout=60) is None
        client.stop_stream(cancel_requests=True)
        client.close()

    threads = [threading.Thread(target=leave_early, args=(i,)) for i in range(gone)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)

    def ended(reason):
        return _metric(server, "tfgraph_requests_ended_total", reason=reason) - before[reason]

    assert _wait_for(lambda: _metric(server, "tfgraph_slots_active") == 0)
    assert ended("cancelled") + ended("unreachable") == gone
    assert ended("finished") == 0  # none ran on to its thousands of tokens
    tokens, error = _stream(server, [4, 5, 6], max_new_tokens=6)  # the slots serve again
    want = generate(decoder, [[4, 5, 6]], GenerationConfig(max_new_tokens=6)).tokens[0]
    assert error is None and tokens == want


BAD = [
    ({"prompt": []}, "prompt is empty"),
    ({"prompt": [1, 2], "max_new_tokens": CAPACITY}, f"a slot holds {CAPACITY}"),
    ({"prompt": [1, 2], "beam_width": 2}, "unknown parameter"),
    ({"prompt": [1, 2], "temperature": "hot"}, "temperature must be a number"),
    ({"prompt": [1, 100_000]}, "vocabulary"),
]


def _load(server, decoder, requests: int, clients: int = 8) -> None:
    rng = np.random.default_rng(requests)
    plan = []
    for i in range(requests):
        if i % 6 == 5:  # one in six is bad
            plan.append(BAD[(i // 6) % len(BAD)])
        else:
            prompt = rng.integers(1, 200, int(rng.integers(1, 48))).tolist()
            plan.append(({"prompt": prompt, "max_new_tokens": int(rng.integers(1, 40))}, None))
    got = [None] * requests
    warm = {}
    done = queue.Queue()
    for i in range(requests):
        done.put(i)

    def client():
        while True:
            try:
                i = done.get_nowait()
            except queue.Empty:
                return
            kwargs = dict(plan[i][0])
            got[i] = _stream(server, kwargs.pop("prompt"), **kwargs)
            if i == requests // 4:  # after warm-up
                warm["rss"] = _metric(server, "tfgraph_model_rss_bytes")

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    for (kwargs, needle), (tokens, error) in zip(plan, got, strict=True):
        if needle is not None:
            assert tokens == [] and error is not None and needle in str(error), str(error)
        else:
            config = GenerationConfig(max_new_tokens=kwargs["max_new_tokens"])
            want = generate(decoder, [kwargs["prompt"]], config).tokens[0]
            assert error is None and tokens == want
    assert _wait_for(lambda: _metric(server, "tfgraph_slots_active") == 0)
    assert _metric(server, "tfgraph_requests_waiting") == 0
    rss = _metric(server, "tfgraph_model_rss_bytes")
    assert rss <= warm["rss"] * 1.05 + 8 * 2**20, (warm["rss"], rss)  # flat after warm-up


def test_requests_of_random_lengths_with_bad_ones_mixed_in(served):
    _load(*served, requests=48)


# slow: the in-flight server's fault load at full size (200 requests, bad ones mixed in); the
# default tier runs it with 48
@pytest.mark.slow
def test_two_hundred_requests_with_bad_ones_mixed_in(served):
    _load(*served, requests=200)
