"""Serving under load: the Triton generation model against local ``generate``, in one run.

For gpt2-tiny and (full runs) GPT-2-small, the zoo presets exported with the KV cache, the
repository of ``tfgraph triton`` is served by the ``nvidia-pytriton`` wheel's ``tritonserver``
(CPU, Python backend) and driven by C concurrent gRPC streaming clients (C = 1, 4, 16), each
sending one request after another for the duration of a round: a 16-token prompt, greedy
``max_new_tokens`` tokens. Measured per C: **generated tokens/s** (all clients' tokens ÷ the
round's wall time), **time to first token** (median over requests) and the **p50 / p99
per-token latency** (the gaps between a stream's consecutive tokens). **Local** is
``tfgraph.runtime.stream`` on the same artifact in a fresh process without torch, one request
at a time: the same figures at C = 1; ``overhead`` = local tokens/s ÷ served tokens/s at C = 1.
The generation model runs in both batching modes in the same server and run (``batching``:
``static``, the requests that arrive together; ``inflight``, cache slots joined at every step).

    python -m tfgraph.bench.serving [--quick] [--out serving.json]
    (or as the ``serving`` section of ``python -m tfgraph bench``)
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

PROMPT = 16
BATCHING = ("static", "inflight")  # the generation model's two modes, same server and run
CONCURRENCY = (1, 4, 16)
LOCAL_PROBE = r"""
import json, sys, time
import numpy as np
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, stream
path, prompt, new, requests = sys.argv[1], *map(int, sys.argv[2:5])
decoder = CachedDecoder(Session(path, threads=2))
rng = np.random.default_rng(0)
config = GenerationConfig(max_new_tokens=new)
for _ in stream(decoder, [[1] * prompt], config):  # warm-up
    pass
firsts, gaps, tokens, start = [], [], 0, time.perf_counter()
for _ in range(requests):
    ids = rng.integers(1, 200, prompt).tolist()
    sent = last = time.perf_counter()
    for i, _step in enumerate(stream(decoder, [ids], config)):
        now = time.perf_counter()
        (firsts if i == 0 else gaps).append(now - (sent if i == 0 else last))
        last, tokens = now, tokens + 1
elapsed = time.perf_counter() - start
print(json.dumps({"tokens": tokens, "seconds": elapsed, "firsts": firsts, "gaps": gaps}))
"""


def _summary(tokens: int, seconds: float, firsts: list, gaps: list) -> dict:
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ttft_ms_p50": 1e3 * float(np.percentile(firsts, 50)),
        "token_ms_p50": 1e3 * float(np.percentile(gaps, 50)),
        "token_ms_p99": 1e3 * float(np.percentile(gaps, 99)),
        "requests": len(firsts),
    }


def local(artifact: Path, new: int, requests: int) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", LOCAL_PROBE, str(artifact), str(PROMPT), str(new), str(requests)],
        capture_output=True,
        text=True,
        check=True,
    )
    d = json.loads(out.stdout.strip().splitlines()[-1])
    return _summary(d["tokens"], d["seconds"], d["firsts"], d["gaps"])


def served(server, model: str, concurrency: int, new: int, per_client: int) -> dict:
    from tfgraph.serving.client import stream_tokens

    firsts, gaps, counts, errors = [], [], [0] * concurrency, []
    lock = threading.Lock()

    def client(i: int) -> None:
        rng = np.random.default_rng(100 + i)
        try:
            for _ in range(per_client):
                ids = rng.integers(1, 200, PROMPT).tolist()
                sent = last = time.perf_counter()
                mine_first, mine_gaps = None, []
                for n, _ in enumerate(
                    stream_tokens(server.grpc_url, model, ids, max_new_tokens=new)
                ):
                    now = time.perf_counter()
                    if n == 0:
                        mine_first = now - sent
                    else:
                        mine_gaps.append(now - last)
                    last = now
                    counts[i] += 1
                with lock:
                    firsts.append(mine_first)
                    gaps.extend(mine_gaps)
        except Exception as exc:  # noqa: BLE001 - recorded; the round reports it
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(errors[0])
    return {"concurrency": concurrency, **_summary(sum(counts), seconds, firsts, gaps)}


def measure(name: str, preset: str, workdir: Path, new: int, rounds: dict, quick: bool) -> dict:
    from tfgraph.bench import shared
    from tfgraph.serving import write_repository
    from tfgraph.serving.launcher import TritonServer

    artifact = workdir / name
    result = shared.export(preset, artifact, kv_cache=True)
    if not result.passed:
        raise RuntimeError(f"{preset}: parity failed")
    repo = workdir / f"{name}-repo"
    models = {}  # batching mode -> the generation model serving with it
    for mode in BATCHING:
        part = workdir / f"{name}-{mode}"
        written = write_repository(artifact, part, name=f"{name}_{mode}", batching=mode)
        model = f"{name}_{mode}_generate"
        notes = next(m.notes for m in written if m.name == model)
        repo.mkdir(exist_ok=True)
        (part / model).rename(repo / model)
        models[mode] = (model, notes)
    row: dict = {"preset": preset, "new_tokens": new, "prompt": PROMPT}
    row["local"] = local(artifact / "model.onnx", new, rounds[1] * 2)
    row["served"] = []  # static batching, as before
    row["batching"] = {}
    with TritonServer(repo, load=[m for m, _ in models.values()], startup_timeout=120) as server:
        for mode, (model, notes) in models.items():
            served(server, model, 1, new, 1)  # warm-up
            runs = [
                served(server, model, c, new, rounds[c])
                for c in (CONCURRENCY if not quick else CONCURRENCY[:2])
            ]
            row["batching"][mode] = {"notes": notes, "served": runs}
    row["served"] = row["batching"]["static"]["served"]
    one = row["served"][0]
    row["overhead_at_1"] = row["local"]["tokens_per_s"] / one["tokens_per_s"]
    return row


def run(quick: bool, workdir: Path, progress=lambda step: None, only=None) -> dict:
    from tfgraph.errors import TfgraphError
    from tfgraph.serving.launcher import find_tritonserver

    try:
        find_tritonserver()
    except TfgraphError as exc:
        return {"skipped": str(exc)}
    from .exporters import _commit

    plan = [("gpt2-tiny", "gpt2-tiny", 64, {1: 4, 4: 2, 16: 1})]
    if not quick:
        plan.append(("gpt2-small", "gpt2-small", 64, {1: 3, 4: 1, 16: 1}))
    models = {}
    for name, preset, new, rounds in plan:
        if only and name not in only:
            continue
        progress(f"serving: {name}")
        models[name] = measure(name, preset, workdir, new, rounds, quick)
    return {
        "date": time.strftime("%Y-%m-%d"),
        "commit": _commit(),
        "concurrency": list(CONCURRENCY if not quick else CONCURRENCY[:2]),
        "models": models,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="serving.json")
    parser.add_argument("--only", nargs="+", help="models to run (gpt2-tiny, gpt2-small)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="tfgraph-serving-") as tmp:
        data = run(args.quick, Path(tmp), lambda s: print(s, file=sys.stderr), args.only)
    Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
