"""``python -m tfgraph quality DIR --text FILE``: how much an artifact's formats cost, measured
over a text against the fp32 eager model it was exported from.

The text is tokenized with the artifact's own tokenizer and cut as
:func:`tfgraph.tools.train_reference.perplexity` cuts it: consecutive windows of ``window``
input tokens, each predicting the token after each of its positions (the last one predicts the
first token of the next window), so every token but the first is scored exactly once and no
window sees another's tokens. Both models see the same windows:

1. **the artifact**, through the runtime (:func:`tfgraph.runtime.open_runner`): a KV-cached
   decoder by a prefill on an empty cache (:class:`tfgraph.runtime.CachedDecoder`), a
   cacheless one by a plain run; a few windows a run. Its logits (cast to float32, whatever
   the manifest's precision) are kept in memory when small, else in a temporary file
   (:mod:`tfgraph.verify.quality_store`). The session is then released;
2. **the fp32 eager model** the artifact's ``report.json`` names (the source itself, never the
   dequantized copy parity uses: quantization is what is being measured). A safetensors
   checkpoint's source is streamed (a block's weights at a time,
   :mod:`tfgraph.sources.streamed`), so the windows go through it in batches (each batch's
   logits at most :data:`PASS_BYTES`): one pass over the weights serves several windows.

Both go through :class:`tfgraph.verify.quality_metrics.QualityTally` window by window: the
perplexity of each, ΔPPL, mean and max KL(fp32 ‖ artifact), top-1 agreement.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tfgraph import contract
from tfgraph.errors import TfgraphError
from tfgraph.progress import tick
from tfgraph.verify.quality_metrics import QualityTally
from tfgraph.verify.quality_store import LogitStore, batches, stacked, windows
from tfgraph.verify.recheck import read_report

logger = logging.getLogger(__name__)

MAX_WINDOW = 512  # the default window: the model's context, at most this many tokens
PASS_BYTES = 256 << 20  # one run's (one eager pass's) logits at most this many bytes
MAX_BATCH = 8  # windows in one run of the artifact, whatever their size


def measure_quality(
    artifact_dir: str | Path,
    text_path: str | Path,
    *,
    window: int | None = None,
    max_tokens: int | None = None,
    progress: Callable[[str], None] | None = None,
    source=None,
) -> dict:
    """The artifact in ``artifact_dir`` against its fp32 eager source over the text in
    ``text_path`` (module docstring): :meth:`QualityTally.figures` and ``text``, ``window``,
    ``windows``, ``artifact``, ``reference``, ``seconds``. ``window``: input tokens per window
    (default: the model's context, at most :data:`MAX_WINDOW`); ``max_tokens``: only the
    text's first tokens; ``progress``: told a line as each phase starts; ``source``: the fp32
    source when the caller holds it (the export's), else the one ``report.json`` names."""
    start = time.perf_counter()
    say = progress or (lambda _line: None)
    directory = Path(artifact_dir)
    report = read_report(directory, "quality")
    ids = text_tokens(directory, text_path, max_tokens)
    size = _window(window, directory, report)
    spans = windows(len(ids), size)
    say(f"artifact over {len(spans)} windows of {size} tokens")
    logger.info("quality: %d tokens, %d windows of %d", len(ids), len(spans), size)
    with LogitStore(len(ids) - 1) as store:
        _run_artifact(directory, ids, spans, store)
        gc.collect()  # the session's memory goes back before the fp32 model loads
        origin = report["model"]
        say(f"fp32 eager {origin} over {len(spans)} windows")
        source = source if source is not None else fp32_source(directory, report)
        tally = _run_reference(source, ids, spans, store)
    figures = tally.figures()
    seconds = round(time.perf_counter() - start, 3)
    logger.info(
        "quality: ppl %.4f (fp32 %.4f), %.1f s", figures["ppl"], figures["ppl_ref"], seconds
    )
    return {
        **figures,
        "text": str(text_path),
        "window": size,
        "windows": len(spans),
        "artifact": str(directory),
        "reference": f"fp32 eager {origin}",
        "seconds": seconds,
    }


def text_tokens(directory: Path, text_path: str | Path, max_tokens: int | None) -> np.ndarray:
    """The text's token ids by the artifact's own tokenizer (at most ``max_tokens``)."""
    from tfgraph.runtime.tokenizer import load_tokenizer

    text_path = Path(text_path)
    if not text_path.is_file():
        raise TfgraphError(f"no text file at '{text_path}': give --text a UTF-8 text file")
    if not (directory / "tokenizer").is_dir():
        raise TfgraphError(
            f"'{directory}' carries no tokenizer: export it from a Hugging Face directory with "
            "one (or export … with a tokenizer=) to measure its quality over a text"
        )
    if max_tokens is not None and max_tokens < 2:
        raise TfgraphError(f"--max-tokens must be at least 2, got {max_tokens}")
    tokenizer = load_tokenizer(directory)
    text = text_path.read_text(encoding="utf-8", errors="replace")
    ids = np.asarray(tokenizer(text)["input_ids"], np.int64)[:max_tokens]
    if len(ids) < 2:
        raise TfgraphError(
            f"'{text_path}' is {len(ids)} token(s) long: perplexity needs at least 2; give a "
            "longer text"
        )
    return ids


def check_measurable(source, kv_layout: str = "shared") -> None:
    """Refuse, before an export's slow work, an export whose artifact quality cannot be
    measured here: no tokenizer will be in it (neither given with the model nor in its
    Hugging Face directory), a vision-language model's graph, a paged cache (CUDA only)."""
    from tfgraph.exporters.write import TOKENIZER_FILES

    origin = source.origin
    if origin.startswith("vision-language:"):
        raise TfgraphError(
            "--quality-text measures a decoder-only language model, not a vision-language "
            "model's graphs; drop it"
        )
    if kv_layout == "paged":
        raise TfgraphError(
            "--quality-text runs the artifact on the CPU and a paged KV cache runs on ONNX "
            "Runtime's CUDA provider only; drop --kv-layout paged or --quality-text"
        )
    directory = Path(origin[3:]) if origin.startswith("hf:") else None
    found = directory is not None and any((directory / n).is_file() for n in TOKENIZER_FILES)
    if source.tokenizer is None and not found:
        raise TfgraphError(
            f"--quality-text needs a tokenizer in the artifact and {origin} has none: export "
            "a Hugging Face directory with one, or export … with a tokenizer (tokenizer=)"
        )


def _window(window: int | None, directory: Path, report: dict) -> int:
    """The window asked for, else the model's context (manifest, source info) up to
    :data:`MAX_WINDOW`; refused past the model's positions."""
    from tfgraph.exporters.manifest import read_manifest

    limit = (read_manifest(directory) or {}).get("max_positions") or (
        report.get("source") or {}
    ).get("max_positions")
    if window is None:
        return min(limit or MAX_WINDOW, MAX_WINDOW)
    if window < 1:
        raise TfgraphError(f"--window must be at least 1 token, got {window}")
    if limit and window > limit:
        raise TfgraphError(
            f"--window {window} is past the model's {limit} positions; give --window {limit} "
            "or less"
        )
    return window


def _run_artifact(directory: Path, ids: np.ndarray, spans, store: LogitStore) -> None:
    """The artifact's logits of every window into ``store``; the session released after."""
    from tfgraph.runtime import CachedDecoder, open_runner

    runner = open_runner(directory)
    signature = runner.signature
    logits_port = signature.output(contract.LOGITS)
    if logits_port is None:
        names = ", ".join(p.name for p in signature.outputs)
        raise TfgraphError(
            f"'{directory}' is not a decoder with logits (outputs: {names}); quality measures "
            "a language model's next-token predictions"
        )
    decoder = CachedDecoder(runner) if signature.cached else None
    if decoder is not None and decoder.seq2seq:
        raise TfgraphError(
            f"'{directory}' is an encoder-decoder: quality measures a decoder-only language model"
        )
    shape = logits_port.shape or [None]
    vocab = shape[-1] if isinstance(shape[-1], int) else store.vocab_hint
    done = 0
    try:
        for group in batches(spans, vocab, PASS_BYTES, MAX_BATCH):
            tokens = stacked(ids, group)
            if decoder is not None:
                cache = decoder.empty_cache(len(group), tokens.shape[1])
                logits, _ = decoder.step(tokens, cache)
            else:
                feeds = _feeds(signature.inputs, tokens, lambda p: p.name)
                logits = runner.run(feeds)[logits_port.name]
            logits = np.asarray(runner.to_numpy(logits), np.float32)
            for row, (a, b) in enumerate(group):
                store.put(a, logits[row, : b - a])
            done += len(group)
            tick("windows (artifact)", done, len(spans))
    finally:
        del decoder, runner


def _feeds(ports, tokens: np.ndarray, key) -> dict:
    """A window batch's inputs by role: the tokens, a mask of ones, positions from 0."""
    batch, size = tokens.shape
    feeds = {}
    for port in ports:
        if port.role == contract.TOKEN_IDS:
            feeds[key(port)] = tokens
        elif port.role == contract.ATTENTION_MASK:
            feeds[key(port)] = np.ones((batch, size), np.int64)
        elif port.role == contract.POSITION_IDS:
            feeds[key(port)] = np.broadcast_to(np.arange(size, dtype=np.int64), (batch, size))
        else:
            raise TfgraphError(
                f"quality feeds a decoder's tokens, mask and positions; input '{port.name}' "
                f"({port.role}) is none of them"
            )
    return feeds


def fp32_source(directory: Path, report: dict):
    """The fp32 source ``report.json`` names, loaded as :func:`tfgraph.verify.recheck.
    load_artifact_source` loads it but without the dequantized copy a quantized artifact's
    parity builds (it reads the whole artifact's weights: not what is measured here)."""
    from tfgraph.sources import load_source

    origin = report["model"]
    if origin.startswith("vision-language:"):
        raise TfgraphError(
            f"'{directory}' is a graph of a vision-language model: quality measures a "
            "decoder-only language model"
        )
    info = report.get("source") or {}
    source = load_source(
        origin.partition(":")[2], attn_implementation=info.get("attn_fallback") or None
    )
    if info.get("static_axes_flag"):  # exported with --static-axes: run at those sizes
        from tfgraph.sources.static_axes import with_static_axes

        source = with_static_axes(source, info["static_axes_flag"])
    return source


def _run_reference(source, ids, spans, store: LogitStore) -> QualityTally:
    """The fp32 eager ``source`` over the windows in batches, each window tallied against the
    artifact's logits for it."""
    import torch

    roles = source.roles()
    ports = [contract.Port(n, roles.get(n, (contract.INPUT, None))[0]) for n in source.input_names]
    out = next((n for n in source.output_names if roles.get(n, ("",))[0] == contract.LOGITS), None)
    out = out or source.output_names[0]
    tally, done = QualityTally(), 0
    for group in batches(spans, store.vocab, PASS_BYTES, None):
        tokens = stacked(ids, group)
        feeds = _feeds(ports, tokens, lambda p: p.name)
        inputs = {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in feeds.items()}
        logits = source.eager(inputs)[out].float().numpy()
        for row, (a, b) in enumerate(group):
            tally.add(logits[row, : b - a], store.get(a, b - a), ids[a + 1 : b + 1])
        done += len(group)
        tick("windows (fp32 eager)", done, len(spans))
        del logits
    return tally
