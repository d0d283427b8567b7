"""The bridge from ``tfgraph serve``'s request handlers to the in-flight batcher.

One scheduler thread owns a :class:`tfgraph.runtime.SlotBatcher` (``slots`` cache rows of
``capacity`` positions). Handlers, on the server's event loop, :meth:`Engine.submit` a checked
request and read its tokens from the :class:`Job` they get back; the thread, before every
decoding step, admits waiting jobs into free slots, then runs one step for every active slot
together (:meth:`SlotBatcher.step`: a decoding step and, chunked prefill, up to
``prefill_chunk`` prompt tokens of the jobs still prefilling) and sends each job its new
tokens through the event loop (``call_soon_threadsafe``); a job's first token comes with its
prompt's last chunk. Prompts sharing a prefix reuse its K/V blocks (``prefix_cache_mb``,
:mod:`tfgraph.runtime.prefix_cache`); with ``speculative`` each step verifies every slot's
drafts and may give a job several tokens (:mod:`tfgraph.runtime.inflight_speculative`), sent
in order. A job leaves its slot at its
``max_new_tokens`` or EOS, or when its handler cancels it (a stop string matched, the client
went away): checked after every step. The loop is the one the Triton generation model runs
(:mod:`.triton_generate`), without Triton: each request's tokens are those of
:func:`tfgraph.runtime.generate` on its prompt alone (greedy and seeded sampling), up to the
fp32 noise of a batched step.

A vision-language artifact (``export`` of a VLM directory) is served the same way: its
:attr:`Engine.images` (:class:`tfgraph.runtime.vision_language.ImagePrompts`: the model's own
processor and the vision graph) turn a prompt and its image into token ids and the decoder's
per-prompt inputs, which a job carries into its slot (:meth:`SlotBatcher.admit`'s ``extra``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tfgraph.errors import TfgraphError
from tfgraph.runtime.generate import CachedDecoder, GenerationConfig
from tfgraph.runtime.inflight import Request, inflight_support
from tfgraph.runtime.inflight_speculative import draft_artifact, make_batcher

logger = logging.getLogger(__name__)

DEFAULT_SLOTS = 16
DEFAULT_CAPACITY = 1024  # positions per slot when the model allows more
# prompt tokens prefilled per step (chunked prefill, SlotBatcher's prefill_chunk; 0: each
# prompt whole at once): a decode step waits for at most this many (docs/serving.md measures)
DEFAULT_PREFILL_CHUNK = 64
# prefix caching's store (0: off): 256 MiB holds ~3,600 tokens of GPT-2-small's fp32 K/V
# (72 KiB a token), ~14,000 of an int8 cache; blocks past it are evicted least recently used
DEFAULT_PREFIX_CACHE_MB = 256


@dataclass
class Event:
    """What the scheduler sends a job: a token (``finished`` when it was the last one), or
    the error that ended it."""

    token: int | None = None
    finished: bool = False
    error: str | None = None


@dataclass
class Job:
    """One request, from its handler to the scheduler and back."""

    prompt: list[int]
    config: GenerationConfig
    seed: int | None
    loop: asyncio.AbstractEventLoop
    extra: dict | None = None  # a vision-language prompt's own inputs (image features)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    request: Request | None = None  # its slot's request, once admitted
    sent: int = 0  # its request's tokens sent so far

    def send(self, event: Event) -> None:
        """From the scheduler thread: ``event`` onto the job's queue, on its event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)

    def cancel(self) -> None:
        """Free its slot at the next step (or never admit it)."""
        self.cancelled.set()


class Engine:
    """A cached artifact served in flight: ``slots`` requests decoded at once."""

    def __init__(
        self,
        path: str | Path,
        *,
        slots: int = DEFAULT_SLOTS,
        capacity: int | None = None,
        threads: int | None = None,
        providers: Sequence[str] | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
        speculative: str | None = None,
        speculative_k: int = 4,
    ) -> None:
        from tfgraph.exporters.manifest import read_manifest
        from tfgraph.runtime import open_runner
        from tfgraph.runtime.vision_language import ImagePrompts, vision_language

        options = {"threads": threads} if threads else {}
        if providers:
            options["providers"] = list(providers)
        if speculative and draft_artifact(speculative, speculative_k) is not None:
            options["spinning"] = False  # it takes turns with the draft's session
        self.decoder = CachedDecoder(open_runner(path, **options))
        if self.decoder.seq2seq:
            raise TfgraphError(
                f"'{path}' is an encoder-decoder: tfgraph serve serves decoder-only models "
                "(serve it with tfgraph triton)"
            )
        why = inflight_support(self.decoder)
        if why is not None:
            raise TfgraphError(f"tfgraph serve batches in flight, which '{path}' cannot: {why}")
        limit = self.decoder.max_positions
        capacity = capacity or min(limit or DEFAULT_CAPACITY, DEFAULT_CAPACITY)
        self.batcher = make_batcher(
            self.decoder, slots, capacity, prefill_chunk=prefill_chunk,
            prefix_cache_bytes=int(prefix_cache_mb * 2**20), speculative=speculative,
            speculative_k=speculative_k, threads=threads,
        )  # fmt: skip
        self.images = None  # a vision-language artifact's prompts (processor, vision graph)
        if vision_language(read_manifest(Path(path))) is not None:
            self.images = ImagePrompts(path, providers=providers)
        self.vocab = self._vocabulary()
        self.pending: list[Job] = []
        self.ready = threading.Condition()
        self.stopping = threading.Event()
        self.peak_active = 0  # the most slots one step has run: batching seen
        self.ended = Counter()  # requests that left their slot: finished, cancelled, failed
        self.thread = threading.Thread(target=self._schedule, name="tfgraph-serve", daemon=True)
        self.thread.start()

    @property
    def capacity(self) -> int:
        return self.batcher.capacity

    @property
    def slots(self) -> int:
        return self.batcher.slots

    def _vocabulary(self) -> int | None:
        from tfgraph import contract

        logits = self.decoder.session.signature.output(contract.LOGITS)
        last = (logits.shape or [None])[-1] if logits is not None else None
        return last if isinstance(last, int) else None

    # --- handlers' side (the event loop) --------------------------------------------------
    def check(self, prompt: Sequence[int], config: GenerationConfig) -> None:
        """A TfgraphError naming what is wrong with a request, before it is queued."""
        if self.vocab is not None and any(not 0 <= t < self.vocab for t in prompt):
            raise TfgraphError(f"prompt token ids must lie in [0, {self.vocab}): the vocabulary")
        self.batcher.check(prompt, config)

    def submit(self, prompt: Sequence[int], config: GenerationConfig, seed=None, extra=None) -> Job:
        """Queue a checked request; its tokens arrive on the returned job's ``events``.
        ``extra``: a vision-language prompt's own inputs (:meth:`ImagePrompts.prepare`'s,
        one row)."""
        self.check(prompt, config)
        if self.stopping.is_set():
            raise TfgraphError("the server is shutting down")
        job = Job(list(prompt), config, seed, asyncio.get_running_loop(), extra=extra)
        with self.ready:
            self.pending.append(job)
            self.ready.notify()
        return job

    def close(self, timeout: float = 30) -> None:
        """Stop the scheduler; jobs still waiting or running hear of it."""
        self.stopping.set()
        with self.ready:
            self.ready.notify()
        self.thread.join(timeout)

    # --- the scheduler thread -------------------------------------------------------------
    def _schedule(self) -> None:
        batcher, jobs = self.batcher, {}  # jobs: slot -> Job
        while True:
            with self.ready:
                while not self.pending and not jobs and not self.stopping.is_set():
                    self.ready.wait()
                if self.stopping.is_set():
                    break
                admit = self.pending[: batcher.free]
                del self.pending[: len(admit)]
            for job in admit:  # each joins the running batch in a free slot
                if not job.cancelled.is_set():
                    self._admit(jobs, job)
            if batcher.active:
                self.peak_active = max(self.peak_active, len(batcher.active))
                try:
                    tokens = batcher.step()
                except Exception as exc:  # noqa: BLE001 - its clients hear of it, serving goes on
                    logger.exception("a decoding step failed")
                    for slot, job in list(jobs.items()):
                        batcher.release(slot)
                        job.send(Event(error=f"generation failed: {type(exc).__name__}: {exc}"))
                    self.ended["failed"] += len(jobs)
                    jobs.clear()
                    continue
                for slot in tokens:
                    self._deliver(jobs, slot)
            for slot, job in list(jobs.items()):  # cancelled: its slot is free now
                if job.cancelled.is_set():
                    batcher.release(slot)
                    jobs.pop(slot)
                    self.ended["cancelled"] += 1
        with self.ready:
            left = [*jobs.values(), *self.pending]
            self.pending.clear()
        for job in left:
            try:
                job.send(Event(error="the server is shutting down"))
            except RuntimeError:  # its event loop has closed already: nobody waits for it
                pass

    def _admit(self, jobs: dict, job: Job) -> None:
        try:
            request = self.batcher.admit(job.prompt, job.config, job.seed, extra=job.extra)
        except Exception as exc:  # noqa: BLE001 - this client hears of it
            logger.exception("admitting a request failed")
            job.send(Event(error=f"generation failed: {type(exc).__name__}: {exc}"))
            self.ended["failed"] += 1
            return
        jobs[request.slot] = job
        job.request = request
        if request.tokens:  # else its first token comes from a step (chunked prefill)
            self._deliver(jobs, request.slot)

    def _deliver(self, jobs: dict, slot: int) -> None:
        """The tokens the job in ``slot`` has not been sent yet, in order (a step may give
        several); the last may end it."""
        job = jobs[slot]
        finished, tokens = job.request.finished, job.request.tokens
        try:
            while job.sent < len(tokens):
                job.sent += 1
                job.send(Event(tokens[job.sent - 1], finished and job.sent == len(tokens)))
        except RuntimeError:  # its event loop is closed: nobody reads it any more
            job.cancel()
        if finished:
            jobs.pop(slot)
            self.ended["finished"] += 1
