"""Serving under load: the Triton generation model, static against in-flight batching.

For gpt2-tiny and (full runs) GPT-2-small, the zoo presets exported with the KV cache, the
repository of ``tfgraph triton`` is served by the ``nvidia-pytriton`` wheel's ``tritonserver``
(CPU, Python backend) in each batching mode of the generation model, side by side in one
server and one run:

- ``static``: the requests that arrive together are decoded as one batch until its longest
  request ends (what the generation model did before in-flight batching);
- ``inflight``: cache slots (``--slots`` = the largest concurrency, ``--slot-capacity`` = the
  longest request); a request joins at the next step in a free slot and leaves it when done;
- ``inflight_int8``: the same over the export with an int8 KV cache (``--kv-dtype int8``);
- ``inflight_chunked``: ``inflight`` with chunked prefill (``--prefill-chunk 64``: a new
  request's prompt enters 64 tokens a step between the running requests' steps), where the
  other in-flight modes prefill each prompt whole (``--prefill-chunk 0``, as before);
  ``inflight_chunk32`` and ``inflight_chunk16`` the same in chunks of 32 and 16.

Besides, the **decode step** of 1 and 16 rows at past 512 with the fp32 and the int8 cache
(in-flight slots, each in a fresh process without torch, alternated, medians of 3 rounds).

C concurrent gRPC streaming clients (C = 1, 4, 16, 32) each send requests back to back for a
round of fixed duration: a **mixed workload**, prompt lengths uniform in 8–256 tokens and
``max_new_tokens`` uniform in 16–256 (greedy), each client drawing its own seeded sequence,
the same sequences in both modes. Measured per mode and C: **generated tokens/s** (all tokens
÷ the round's wall time, the last requests finished), **time to first token** p50 / p99 and
**per-token latency** p50 / p99 (the gaps between a stream's consecutive tokens), and the KV
cache memory of a slot. **Local** is ``tfgraph.runtime.stream`` on the same artifact in a
fresh process without torch, one request at a time over client 0's sequence.

The modes of one model are interleaved at each level of C. **Shared prefix** (its own run):
16 clients at once, each prompt a 1,000-token prefix (new each round) and its own 8-64-token
tail, on a random Llama-shaped model sized like GPT-2-small with 2,048 positions (gpt2 holds
1,024), served with and without prefix caching (``--prefix-cache-mb 256`` / ``0``, both in
chunks of 64), alternated over two rounds: time to first token p50 / p99.

    python -m tfgraph.bench.serving [--quick] [--out serving.json] [--only gpt2-small
        shared-prefix] [--modes inflight inflight_chunked] [--levels 1 4 16]
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

CONCURRENCY = (1, 4, 16, 32)
CHUNK = 64  # chunked prefill's prompt tokens per step (tfgraph serve's and triton's default)
# the generation model's modes, same server and run: (batching, the cache's dtype, prompt
# tokens prefilled per step: 0 whole, as before chunked prefill); no prefix cache (the mixed
# load's prompts share nothing)
BATCHING = {"static": ("static", "fp32", 0), "inflight": ("inflight", "fp32", 0),
            "inflight_int8": ("inflight", "int8", 0),
            "inflight_chunked": ("inflight", "fp32", CHUNK),
            "inflight_chunk32": ("inflight", "fp32", CHUNK // 2),
            "inflight_chunk16": ("inflight", "fp32", CHUNK // 4)}  # fmt: skip
STEP_PAST, STEP_BATCHES, STEP_ROUNDS = 512, (1, 16), 3  # the decode-step comparison
PROMPTS = (8, 256)  # prompt lengths, uniform (inclusive)
NEW_TOKENS = (16, 256)  # max_new_tokens, uniform (inclusive)
LOCAL_PROBE = r"""
import json, sys, time
import numpy as np
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, stream
path, requests = sys.argv[1], json.loads(sys.argv[2])
decoder = CachedDecoder(Session(path, threads=2))
for _ in stream(decoder, [[1] * 8], GenerationConfig(max_new_tokens=4)):  # warm-up
    pass
firsts, gaps, tokens, start = [], [], 0, time.perf_counter()
for ids, new in requests:
    sent = last = time.perf_counter()
    for i, _step in enumerate(stream(decoder, [ids], GenerationConfig(max_new_tokens=new))):
        now = time.perf_counter()
        (firsts if i == 0 else gaps).append(now - (sent if i == 0 else last))
        last, tokens = now, tokens + 1
elapsed = time.perf_counter() - start
print(json.dumps({"tokens": tokens, "seconds": elapsed, "firsts": firsts, "gaps": gaps}))
"""


STEP_PROBE = r"""
import json, sys, time
import numpy as np
from tfgraph.runtime import CachedDecoder, GenerationConfig, Session, SlotBatcher
path, past, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
decoder = CachedDecoder(Session(path, threads=2))
slots = SlotBatcher(decoder, batch, past + 64)
for i in range(batch):
    slots.admit([(7 * i + j) % 200 + 1 for j in range(past)], GenerationConfig(max_new_tokens=60))
for _ in range(3):
    slots.step()
times = []
for _ in range(20):
    start = time.perf_counter()
    slots.step()
    times.append(time.perf_counter() - start)
print(json.dumps({"step_ms": 1e3 * float(np.median(times))}))
"""


def decode_steps(artifacts: dict[str, Path], rounds: int, past: int = STEP_PAST) -> dict:
    """The step of ``batch`` rows at ``past`` per cache dtype, each in a fresh process without
    torch, the dtypes alternated ``rounds`` times; medians of the rounds."""
    out = {"past": past}
    for batch in STEP_BATCHES:
        times = {dtype: [] for dtype in artifacts}
        for _ in range(rounds):
            for dtype, path in artifacts.items():
                done = subprocess.run(
                    [sys.executable, "-c", STEP_PROBE, str(path), str(past), str(batch)],
                    capture_output=True, text=True, check=True,
                )  # fmt: skip
                times[dtype].append(json.loads(done.stdout.strip().splitlines()[-1])["step_ms"])
        out[str(batch)] = {dtype: float(np.median(t)) for dtype, t in times.items()}
        out[str(batch)]["rounds"] = {dtype: t for dtype, t in times.items()}
    return out


def workload(
    client: int, count: int, prompts=PROMPTS, new_tokens=NEW_TOKENS, vocab: int = 200
) -> list[tuple[list[int], int]]:
    """Client ``client``'s requests: (prompt ids, max_new_tokens), seeded by the client."""
    rng = np.random.default_rng(1000 + client)
    out = []
    for _ in range(count):
        n = int(rng.integers(prompts[0], prompts[1] + 1))
        new = int(rng.integers(new_tokens[0], new_tokens[1] + 1))
        out.append((rng.integers(1, vocab, n).tolist(), new))
    return out


def _summary(tokens: int, seconds: float, firsts: list, gaps: list) -> dict:
    def pct(values, q):
        return 1e3 * float(np.percentile(values, q)) if values else None

    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ttft_ms_p50": pct(firsts, 50),
        "ttft_ms_p99": pct(firsts, 99),
        "token_ms_p50": pct(gaps, 50),
        "token_ms_p99": pct(gaps, 99),
        "requests": len(firsts),
    }


def local(artifact: Path, requests: list) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", LOCAL_PROBE, str(artifact), json.dumps(requests)],
        capture_output=True,
        text=True,
        check=True,
    )
    d = json.loads(out.stdout.strip().splitlines()[-1])
    return _summary(d["tokens"], d["seconds"], d["firsts"], d["gaps"])


def served(
    server, model: str, concurrency: int, duration: float, shape=(PROMPTS, NEW_TOKENS),
    requests=None,
) -> dict:  # fmt: skip
    """C clients sending their workloads back to back until ``duration`` seconds have
    passed (each finishes the request it is in); ``requests(i)``: client i's instead, each
    sent once."""
    from tfgraph.runtime.serving.client import stream_tokens

    if requests is not None:
        duration = float("inf")  # each client's own requests, once

    firsts, gaps, counts, errors = [], [], [0] * concurrency, []
    lock = threading.Lock()
    start = time.perf_counter()

    def client(i: int) -> None:
        try:
            mine = requests(i) if requests is not None else workload(i, 10_000, *shape)
            for ids, new in mine:
                if time.perf_counter() - start >= duration:
                    return
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
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(errors[0])
    return {"concurrency": concurrency, **_summary(sum(counts), seconds, firsts, gaps)}


def measure(
    name: str, preset: str, workdir: Path, duration: float, quick: bool, shape,
    modes=tuple(BATCHING), levels=CONCURRENCY,
) -> dict:  # fmt: skip
    from tfgraph.bench import shared
    from tfgraph.runtime.serving import write_repository
    from tfgraph.runtime.serving.launcher import TritonServer

    artifacts = {}
    for dtype in sorted({BATCHING[m][1] for m in modes} | {"fp32"}):
        artifacts[dtype] = workdir / f"{name}-{dtype}"
        result = shared.export(preset, artifacts[dtype], kv_cache=True, kv_dtype=dtype)
        if not result.passed:
            raise RuntimeError(f"{preset} ({dtype} cache): parity failed")
    artifact = artifacts["fp32"]
    levels = levels if not quick else levels[:2]
    prompts, new_tokens = shape
    capacity = prompts[1] + new_tokens[1]
    repo = workdir / f"{name}-repo"
    models = {}  # batching mode -> (the generation model serving with it, its notes)
    for mode in modes:
        batching, dtype, chunk = BATCHING[mode]
        part = workdir / f"{name}-{mode}"
        written = write_repository(
            artifacts[dtype], part, name=f"{name}_{mode}", batching=batching,
            concurrency=max(levels), slot_capacity=capacity if batching == "inflight" else None,
            prefill_chunk=chunk, prefix_cache_mb=0,
        )  # fmt: skip
        model = f"{name}_{mode}_generate"
        repo.mkdir(exist_ok=True)
        (part / model).rename(repo / model)
        models[mode] = (model, next(m.notes for m in written if m.name == model))
    row: dict = {"preset": preset, "prompts": prompts, "new_tokens": new_tokens}
    row["duration_s"] = duration
    row["kv_bytes_per_slot"] = {d: _kv_bytes_per_slot(a, capacity) for d, a in artifacts.items()}
    limit = result.manifest.get("max_positions") or STEP_PAST + 64
    past = min(STEP_PAST, limit - 64)  # gpt2-tiny holds 128 positions
    if len(artifacts) > 1:  # the fp32 and int8 caches' steps
        row["decode_step"] = decode_steps(artifacts, 1 if quick else STEP_ROUNDS, past)
    row["local"] = local(artifact / "model.onnx", workload(0, 3 if quick else 6, *shape))
    row["batching"] = {}
    with TritonServer(repo, load=[m for m, _ in models.values()], startup_timeout=120) as server:
        for mode, (model, notes) in models.items():
            served(server, model, 1, 0.0, shape)  # warm-up: one request
            row["batching"][mode] = {"notes": notes, "served": []}
        for c in levels:  # the modes interleaved at each level
            for mode, (model, _) in models.items():
                row["batching"][mode]["served"].append(served(server, model, c, duration, shape))
    return row


# the shared-prefix run: a Llama-shaped random model sized like GPT-2-small (768 wide, 12
# layers; 4 KV heads) holding 2,048 positions; 16 clients at once, each prompt a 1,000-token
# prefix (a new one each round) and its own 8-64-token tail
PREFIX_MODEL = {"d_model": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "d_ff": 2048,
                "vocab_size": 32000, "max_seq_len": 2048}  # fmt: skip
PREFIX_QUICK = {"d_model": 64, "n_layers": 2, "vocab_size": 256, "max_seq_len": 512}
PREFIX, PREFIX_CLIENTS, PREFIX_NEW, PREFIX_MB = 1000, 16, 32, 256


def prefix_requests(round_: int, prefix: int, vocab: int):
    """Client i's request in round ``round_``: the round's prefix, then i's own tail."""
    shared = np.random.default_rng(round_).integers(1, vocab, prefix).tolist()

    def requests(i: int) -> list:
        tail = np.random.default_rng(1000 * round_ + i + 1)
        return [(shared + tail.integers(1, vocab, int(tail.integers(8, 65))).tolist(), PREFIX_NEW)]

    return requests


def shared_prefix(workdir: Path, quick: bool, rounds: int = 2) -> dict:
    """TTFT of 16 clients sharing a prefix, with and without prefix caching (both with chunked
    prefill), in one server, the two alternated over ``rounds`` rounds (fresh prefixes)."""
    from dataclasses import replace

    import tfgraph
    from tfgraph.bench import shared
    from tfgraph.models import PRESETS, build
    from tfgraph.runtime.serving import write_repository
    from tfgraph.runtime.serving.launcher import TritonServer

    sizes = PREFIX_QUICK if quick else PREFIX_MODEL
    prefix = 200 if quick else PREFIX
    config = replace(PRESETS["llama-tiny"], **sizes)
    artifact = workdir / "prefix-llama"
    source = tfgraph.from_module(build(config), origin="llama-2k-random")
    if not shared.export(source, artifact, kv_cache=True).passed:
        raise RuntimeError("the shared-prefix model: parity failed")
    repo, models = workdir / "prefix-repo", {}
    for mode, mb in (("no_prefix_cache", 0), ("prefix_cache", PREFIX_MB)):
        part = workdir / f"prefix-{mode}"
        write_repository(
            artifact, part, name=mode, batching="inflight", concurrency=PREFIX_CLIENTS,
            slot_capacity=prefix + 64 + PREFIX_NEW, prefill_chunk=CHUNK, prefix_cache_mb=mb,
        )  # fmt: skip
        repo.mkdir(exist_ok=True)
        (part / f"{mode}_generate").rename(repo / f"{mode}_generate")
        models[mode] = f"{mode}_generate"
    firsts = {mode: [] for mode in models}
    with TritonServer(repo, load=list(models.values()), startup_timeout=300) as server:
        for model in models.values():  # warm-up: one request sharing nothing
            served(server, model, 1, 0.0, requests=prefix_requests(99, 16, sizes["vocab_size"]))
        for r in range(1 if quick else rounds):
            for mode, model in models.items():
                requests = prefix_requests(r + 1, prefix, sizes["vocab_size"])
                firsts[mode].append(served(server, model, PREFIX_CLIENTS, 0.0, requests=requests))
    out = {"model": sizes, "prefix": prefix, "clients": PREFIX_CLIENTS, "new_tokens": PREFIX_NEW,
           "prefill_chunk": CHUNK, "prefix_cache_mb": PREFIX_MB, "rounds": firsts}  # fmt: skip
    for mode, runs in firsts.items():  # medians of the rounds' figures
        out[mode] = {k: float(np.median([r[k] for r in runs])) for k in ("ttft_ms_p50",
                     "ttft_ms_p99", "tokens_per_s")}  # fmt: skip
    ttft = {mode: out[mode]["ttft_ms_p50"] for mode in firsts}
    out["ttft_p50_ratio"] = ttft["prefix_cache"] / ttft["no_prefix_cache"]
    return out


def _kv_bytes_per_slot(artifact: Path, capacity: int) -> int:
    from tfgraph.runtime import CachedDecoder, Session, SlotBatcher

    batcher = SlotBatcher(CachedDecoder(Session(artifact)), 1, capacity)
    return batcher.kv_bytes_per_slot()


def run(
    quick: bool, workdir: Path, progress=lambda step: None, only=None, modes=None, levels=None
) -> dict:
    """The plan's models (``only``: some of gpt2-tiny, gpt2-small, shared-prefix), each in
    ``modes`` (default all of :data:`BATCHING`) at ``levels`` of concurrency."""
    from tfgraph.errors import TfgraphError
    from tfgraph.runtime.serving.launcher import find_tritonserver

    try:
        find_tritonserver()
    except TfgraphError as exc:
        return {"skipped": str(exc)}
    from tfgraph.bench.exporters import _commit

    # gpt2-tiny holds 128 positions: its workload is a quarter of the size
    plan = [("gpt2-tiny", "gpt2-tiny", 4.0 if quick else 15.0, ((8, 64), (16, 64)))]
    if not quick:
        plan.append(("gpt2-small", "gpt2-small", 30.0, (PROMPTS, NEW_TOKENS)))
    models = {}
    for name, preset, duration, shape in plan:
        if only and name not in only:
            continue
        progress(f"serving: {name}")
        models[name] = measure(
            name, preset, workdir, duration, quick, shape, tuple(modes or BATCHING),
            tuple(levels or CONCURRENCY),
        )  # fmt: skip
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "commit": _commit(),
        "concurrency": list(levels or CONCURRENCY)[: 2 if quick else None],
        "models": models,
    }
    if not only or "shared-prefix" in only:
        progress("serving: shared-prefix")
        out["shared_prefix"] = shared_prefix(workdir, quick)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="serving.json")
    parser.add_argument(
        "--only", nargs="+", help="runs to do (gpt2-tiny, gpt2-small, shared-prefix)"
    )
    parser.add_argument("--modes", nargs="+", choices=list(BATCHING), help="default: all")
    parser.add_argument("--levels", nargs="+", type=int, help="clients (default 1 4 16 32)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="tfgraph-serving-") as tmp:
        progress = lambda s: print(s, file=sys.stderr)  # noqa: E731
        data = run(args.quick, Path(tmp), progress, args.only, args.modes, args.levels)
    Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    print(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
