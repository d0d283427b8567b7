"""Scale-out bench: ``tfgraph serve`` replicas behind haproxy, 1 against 3, and one killed.

    python -m tfgraph.bench.scale_out [--quick] [--out FILE.json]

The trained reference model (``bench/reference_model``, exported with its KV cache in a process
of its own) is served by :class:`~tfgraph.runtime.serving.replicas.ReplicaSet`: 1 replica with
every core, or 3 replicas with the cores shared out, both behind the same haproxy
configuration. C streaming clients (plain HTTP, server-sent events, in this process) each cycle
through their own 8 greedy requests (prompts of 8-64 tokens, 16-64 new tokens), back to back for
D seconds; the two modes alternate in rounds. Then the kill run: 3 replicas under the same
load, the replica serving the most streams SIGKILLed a third of the way in. It reports requests
completed and failed (by replica), whether every completed request has the tokens the other runs
gave the same request, how long haproxy took to mark the replica down, and the survivors'
latency against the 3-replica rounds.

On 2 cores 3 replicas cannot be faster than 1: the work is the same and the cores are the
same (3 one-thread sessions on 2 cores, the clients and haproxy beside them). What scale-out
buys here is that a replica's death costs only its own streams; throughput scales with
machines, which this bench cannot show.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

REFERENCE = Path(__file__).resolve().parent / "reference_model"
CLIENTS = 6
REQUESTS_PER_CLIENT = 8
SERVE = ["--max-batch", "8", "--slot-capacity", "160", "--name", "reference"]


def workload(client: int, vocab: int = 6000) -> list[tuple[list[int], int]]:
    """Client ``client``'s requests, cycled: (prompt ids, new tokens), seeded by the client."""
    rng = np.random.default_rng(4900 + client)
    out = []
    for _ in range(REQUESTS_PER_CLIENT):
        prompt = rng.integers(10, vocab, int(rng.integers(8, 65))).tolist()
        out.append((prompt, int(rng.integers(16, 65))))
    return out


def stream(url: str, prompt: list[int], limit: int, timeout: float = 60.0) -> dict:
    """One greedy streamed completion on a connection of its own (``http.client``: no client
    library between us and the wire): its replica, tokens, times, and error if it failed."""
    import http.client
    import urllib.parse

    body = {"model": "reference", "prompt": prompt, "max_tokens": limit, "temperature": 0,
            "stream": True, "return_token_ids": True}  # fmt: skip
    out = {"replica": None, "tokens": [], "stamps": [], "error": None, "sent": time.monotonic()}
    where = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        answer = conn.getresponse()
        out["replica"] = answer.getheader("x-tfgraph-replica")
        if answer.status != 200:
            raise RuntimeError(f"HTTP {answer.status}: {answer.read()[:200]!r}")
        done = False
        for raw in answer:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                ids = json.loads(line[6:])["choices"][0].get("token_ids") or []
                out["tokens"].extend(ids)
                out["stamps"].extend([time.monotonic()] * len(ids))
        if not done:
            raise RuntimeError("the stream ended without [DONE]")
    except Exception as exc:  # noqa: BLE001 - a killed replica's stream: recorded
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        conn.close()
    out["ended"] = time.monotonic()
    return out


def load(url: str, duration: float, on_start=None) -> list[dict]:
    """CLIENTS clients, each cycling through its workload until ``duration`` has passed."""
    results, lock = [], threading.Lock()
    start = time.monotonic()

    def client(c: int) -> None:
        for n in range(10_000):
            if time.monotonic() - start >= duration:
                return
            i = n % REQUESTS_PER_CLIENT
            prompt, limit = workload(c)[i]
            got = stream(url, prompt, limit)
            with lock:
                results.append({"client": c, "request": i, **got})

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    if on_start is not None:
        on_start(start)
    for t in threads:
        t.join(timeout=duration + 120)
    hung = sum(t.is_alive() for t in threads)
    if hung:
        raise RuntimeError(f"{hung} clients still waiting {duration + 120:.0f} s in: a hang")
    return results


def summary(results: list[dict], seconds: float) -> dict:
    ok = [r for r in results if r["error"] is None]
    firsts = [r["stamps"][0] - r["sent"] for r in ok if r["stamps"]]
    gaps = [g for r in ok for g in np.diff(r["stamps"]).tolist()]
    latency = [r["ended"] - r["sent"] for r in ok]

    def pct(values, q):
        return round(1e3 * float(np.percentile(values, q)), 1) if values else None

    by_replica: dict[str, int] = {}
    for r in ok:
        by_replica[r["replica"]] = by_replica.get(r["replica"], 0) + 1
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "tokens_per_s": round(sum(len(r["tokens"]) for r in ok) / seconds, 1),
        "ttft_ms_p50": pct(firsts, 50),
        "ttft_ms_p99": pct(firsts, 99),
        "token_ms_p99": pct(gaps, 99),
        "latency_ms_p50": pct(latency, 50),
        "latency_ms_p99": pct(latency, 99),
        "completed_by_replica": dict(sorted(by_replica.items())),
    }


def serve_round(artifact: Path, replicas: int, duration: float, kill_at: float | None = None):
    """One run: ``replicas`` behind haproxy under the load; (results, seconds, kill record)."""
    from tfgraph.runtime.serving.replicas import ReplicaSet

    threads = max(1, (os.cpu_count() or 1) // replicas)
    killed = {}
    with tempfile.TemporaryDirectory(prefix="tfgraph-scale-out-") as tmp:
        with ReplicaSet(artifact, replicas, port=0, threads=threads, serve_args=SERVE,
                        config=Path(tmp) / "haproxy.cfg") as group:  # fmt: skip
            started = time.monotonic()

            def killer(start: float) -> None:
                killed["started"] = start
                time.sleep(kill_at)
                victim = _busiest(group)
                killed.update(replica=victim.index, at=time.monotonic())
                os.kill(victim.process.pid, signal.SIGKILL)

            hook = (lambda s: threading.Thread(target=killer, args=(s,), daemon=True).start()) \
                if kill_at is not None else None  # fmt: skip
            results = load(group.url, duration, hook)
            seconds = time.monotonic() - started
            if killed:
                down = [t for t, line in group.events if f"r{killed['replica']} is DOWN" in line]
                killed["detect_s"] = round(down[0] - killed["at"], 3) if down else None
    return results, seconds, killed


def _busiest(group):
    """The live replica with the most established connections (its streams); without ``ss``
    (iproute2), the first live one."""
    if shutil.which("ss") is None:
        return group.alive()[0]
    counts = {}
    for member in group.alive():
        done = subprocess.run(["ss", "-Htn", "state", "established", f"( sport = :{member.port} )"],
                              capture_output=True, text=True)  # fmt: skip
        counts[member.index] = len(done.stdout.splitlines())
    best = max(counts, key=counts.get)
    return group.members[best]


def export_reference(workdir: Path) -> Path:
    out = workdir / "reference-kv"
    if not (out / "model.onnx").exists():
        subprocess.run([sys.executable, "-m", "tfgraph", "export", str(REFERENCE), str(out),
                        "--kv-cache"], check=True, capture_output=True)  # fmt: skip
    return out


def check_tokens(runs: list[list[dict]], reference: dict | None = None) -> dict:
    """Every completed request's tokens against ``reference[(client, request)]`` (else against
    the first completion of the same request)."""
    first = dict(reference or {})
    mismatched = checked = 0
    for results in runs:
        for r in results:
            if r["error"] is not None:
                continue
            key = (r["client"], r["request"])
            if key in first:
                checked += 1
                mismatched += first[key] != r["tokens"]
            else:
                first[key] = r["tokens"]
    return {"checked": checked, "mismatched": mismatched}


def reference_tokens(artifact: Path, eos: int = 2) -> dict:
    """``tfgraph.runtime.generate``'s greedy tokens of every client's requests, one at a time
    (after the timed runs: this process, ONNX Runtime, no torch)."""
    from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner

    decoder = CachedDecoder(open_runner(artifact / "model.onnx"))
    out = {}
    for c in range(CLIENTS):
        for i, (prompt, limit) in enumerate(workload(c)):
            config = GenerationConfig(max_new_tokens=limit, eos_token_id=eos)
            out[(c, i)] = list(generate(decoder, [prompt], config).tokens[0])
    return out


def run(quick: bool, workdir: Path, progress=lambda step: None) -> dict:
    from tfgraph.bench.exporters import _commit
    from tfgraph.errors import TfgraphError
    from tfgraph.runtime.serving.replicas import find_balancer

    try:
        find_balancer("haproxy")
    except TfgraphError as exc:
        return {"skipped": str(exc)}
    duration = 8.0 if quick else 20.0
    rounds = 1 if quick else 2
    progress("scale_out: export the reference model")
    artifact = export_reference(workdir)
    runs, modes = [], {"1": [], "3": []}
    for r in range(rounds):
        for n in (1, 3):
            progress(f"scale_out: round {r + 1}/{rounds}, {n} replica(s)")
            results, seconds, _ = serve_round(artifact, n, duration)
            runs.append(results)
            modes[str(n)].append(summary(results, seconds))
    progress("scale_out: 3 replicas, one killed")
    results, seconds, killed = serve_round(artifact, 3, duration, kill_at=duration / 3)
    runs.append(results)
    lost = [r for r in results if r["error"] is not None]
    kill = {
        **summary(results, seconds),
        "killed_replica": f"r{killed.get('replica')}",
        "detect_s": killed.get("detect_s"),
        "failed_on_killed": sum(r["replica"] == f"r{killed.get('replica')}" for r in lost),
        "failed_elsewhere": sum(r["replica"] != f"r{killed.get('replica')}" for r in lost),
        "errors": sorted({r["error"][:120] for r in lost}),
        "killed_at_s": round(killed["at"] - killed["started"], 3) if killed else None,
        "timeline": [  # each request: start, end (s from the run's start), replica, completed
            [
                round(r["sent"] - killed["started"], 3),
                round(r["ended"] - killed["started"], 3),
                r["replica"],
                r["error"] is None,
            ]
            for r in results
        ]
        if killed
        else [],
    }
    return {
        "date": time.strftime("%Y-%m-%d"),
        "commit": _commit(),
        "load": {"clients": CLIENTS, "seconds": duration, "rounds": rounds, "serve": SERVE},
        "cores": os.cpu_count(),
        "modes": modes,
        "median_tokens_per_s": {
            n: round(float(np.median([m["tokens_per_s"] for m in ms])), 1)
            for n, ms in modes.items()
        },
        "kill": kill,
        "tokens": check_tokens(runs, reference_tokens(artifact)),
        "loadavg_after": os.getloadavg(),
    }


def markdown(d: dict) -> str:
    """The section in BENCHMARKS.md: each mode's rounds, then the kill run."""
    rows = [
        "| replicas | round | completed | failed | tokens/s | TTFT p50 / p99 (ms) "
        "| per-token p99 (ms) | request p99 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    runs = [(n, i + 1, m) for n in ("1", "3") for i, m in enumerate(d["modes"][n])]
    runs.append(("3, one SIGKILLed", "-", d["kill"]))
    for n, r, m in runs:
        rows.append(
            f"| {n} | {r} | {m['completed']} | {m['failed']} | {m['tokens_per_s']} | "
            f"{m['ttft_ms_p50']} / {m['ttft_ms_p99']} | {m['token_ms_p99']} | "
            f"{m['latency_ms_p99']} |"
        )
    k, t, load = d["kill"], d["tokens"], d["load"]
    return "\n".join([
        f"{load['clients']} streaming clients, greedy, {load['seconds']:.0f} s per run, "
        f"{d['cores']} cores shared by the replicas, haproxy and the clients "
        f"({d['date']}, {d['commit']}). Median tokens/s: 1 replica "
        f"{d['median_tokens_per_s']['1']:.1f}, 3 replicas {d['median_tokens_per_s']['3']:.1f}.",
        "",
        *rows, "",
        f"Kill run: {k['killed_replica']} SIGKILLed {k['killed_at_s']} s in; haproxy marked it "
        f"DOWN {k['detect_s']} s later; {k['failed_on_killed']} requests failed on it, "
        f"{k['failed_elsewhere']} elsewhere ({'; '.join(k['errors']) or 'no error'}). Tokens: "
        f"{t['checked']} completed requests of all runs checked against "
        f"tfgraph.runtime.generate's greedy tokens, {t['mismatched']} differed.",
    ])  # fmt: skip


def plot(plt, d: dict, bench: Path) -> list[str]:
    """scale_out.png: tokens/s and latency p99 of 1 and 3 replicas and the kill run; the kill
    run's requests over time, by replica, failed ones marked."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4))
    names = ["1 replica", "3 replicas", "3, one killed"]
    runs = [*(d["modes"][n] for n in ("1", "3")), [d["kill"]]]
    tps = [float(np.median([m["tokens_per_s"] for m in ms])) for ms in runs]
    p99 = [float(np.median([m["latency_ms_p99"] or 0 for m in ms])) for ms in runs]
    xs = np.arange(len(names))
    left.bar(xs - 0.2, tps, 0.4, label="tokens/s (completed requests)")
    twin = left.twinx()
    twin.bar(xs + 0.2, p99, 0.4, color="tab:orange", label="request latency p99 (ms)")
    left.set_xticks(xs, names)
    left.set_ylabel("generated tokens/s")
    twin.set_ylabel("ms")
    left.set_title(f"{d['load']['clients']} streaming clients, {d['cores']} cores")
    left.legend(loc="upper left", fontsize=7)
    twin.legend(loc="upper right", fontsize=7)
    kill = d["kill"]
    for start, end, replica, ok in kill["timeline"]:
        row = int(replica[1:]) if replica else -1
        right.plot([start, end], [row, row], color="tab:blue" if ok else "tab:red", alpha=0.5)
        if not ok:
            right.plot([end], [row], "x", color="tab:red")
    if kill.get("killed_at_s") is not None:
        right.axvline(kill["killed_at_s"], color="k", linestyle=":", label="SIGKILL")
        if kill.get("detect_s") is not None:
            right.axvline(kill["killed_at_s"] + kill["detect_s"], color="grey",
                          linestyle="--", label="haproxy: DOWN")  # fmt: skip
    right.set(xlabel="seconds", ylabel="replica", yticks=[0, 1, 2])
    right.set_title("kill run: each request, start to end (red: failed)")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(bench / "scale_out.png", dpi=100)
    plt.close(fig)
    return ["scale_out.png"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="scale_out.json")
    parser.add_argument("--workdir", help="keep the export here (default: a temporary directory)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    say = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if args.workdir:
        data = run(args.quick, Path(args.workdir), say)
    else:
        with tempfile.TemporaryDirectory(prefix="tfgraph-scale-out-") as tmp:
            data = run(args.quick, Path(tmp), say)
    out = Path(args.out)
    out.write_text(json.dumps(data, indent=1) + "\n")
    if "skipped" not in data:  # matplotlib headless, as bench/plots.py has it (which imports us)
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        plot(plt, data, out.parent)
    print(json.dumps({k: v for k, v in data.items() if k != "kill"}, indent=1))
    print(json.dumps({k: v for k, v in data.get("kill", {}).items() if k != "timeline"}))


if __name__ == "__main__":
    main()
