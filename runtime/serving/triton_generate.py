"""Triton Python-backend model: tfgraph's generation loop over an artifact, tokens streamed.

:mod:`tfgraph.runtime.serving.repository` copies this file as ``model.py`` into ``NAME_generate/1/``
beside a copy of the artifact (``artifact/``). The model is decoupled. With the request
parameter ``stream`` true every chosen token goes back as its own response (``token_id``, and
``token_text`` when the artifact carries a tokenizer), then an empty final response closes the
stream; without it (the default, as in Triton's vLLM and TensorRT-LLM backends) one final
response holds all the tokens and their text, so Triton's HTTP ``generate`` endpoint (exactly
one response) answers 200 with them, or the error's status (400 for a bad request, 500 for a
failed generation, 503 when unloaded) with the error.

**Requests.** ``input_ids`` (INT64, one prompt) or ``text`` (a UTF-8 string, with a tokenizer);
an encoder-decoder's prompt feeds its encoder; a vision-language artifact's also takes
``image`` (BYTES, an image file) with ``text``: its processor places it, the vision graph's
features go into the request's slot (static batching: a batch of its own). Request
parameters: ``stream``, ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``,
``top_p``, ``seed``, ``eos_token_id`` (and ``pad_token_id``, ``decoder_start_token_id``);
``temperature``, ``top_k`` or ``top_p`` imply sampling unless ``do_sample`` is false.
Anything else is refused with one error response naming what was wrong; the server goes on.

**In-flight batching** (``batching: inflight``, written by ``tfgraph triton`` when the artifact
takes per-row past lengths): ``execute`` checks each request (refused at once when it
cannot fit a slot) and queues it; one scheduler thread owns a :class:`SlotBatcher` of
``slots`` cache slots of ``slot_capacity`` positions. Before every step it admits waiting
requests into free slots, then steps every active slot together, each at its own length,
position and sampling state, and prefills up to ``prefill_chunk`` prompt tokens in chunks
(0: each whole at its admission); with
``prefix_cache_mb`` prompts reuse stored prefixes' K/V (:mod:`tfgraph.runtime.prefix_cache`);
with ``speculative`` a step verifies each slot's drafts (several tokens a step, sent in order).
A request leaves its slot the moment it ends (its ``max_new_tokens``, its EOS), or when its
client cancels or disconnects (checked every step; a response that cannot be sent frees the
slot too), and the next waiting request takes it. Its tokens are those of ``tfgraph generate`` on
that prompt alone, up to the fp32 noise of a batched step (tests/runtime/test_inflight.py).

An encoder-decoder's slot also holds its request's cross K/V (up to ``slot_capacity`` tokens).

**Static batching** (``batching: static``: a cache without per-row lengths, a step graph that
takes more per request, or asked for): ``execute`` checks each request and queues it; one
scheduler thread decodes the queue in batches: it takes the oldest request, waits
``batch_wait_ms`` (default 2) for others to arrive, and adds every waiting request with the
same decoding settings (sampling on or off, temperature, top-k, top-p, EOS and pad ids) up to
``concurrency`` rows (default 16) whose longest prompt plus largest ``max_new_tokens`` fits the
model's positions — and, for a model without an ``attention_mask`` input (which would attend to
the padding), the same prompt length. The batch runs as one left-padded generation
(:func:`tfgraph.runtime.stream` with one ``max_new_tokens`` and one seed per row): each row
streams its own tokens and ends at its own limit or EOS; requests that arrive meanwhile form
the next batch when it ends. A row samples from its own seeded generator, so its tokens are
those of ``tfgraph generate`` on that prompt alone up to fp32 noise in the padded batch
(greedy: equal unless two logits tie within that noise).

**Unloading** while streams are in flight: ``finalize`` asks them to stop; each ends with an
error response ("model unloaded while generating") and its final flag.

The Python backend's stub sees its own Python's site-packages (with tfgraph's launcher: the
server environment's, ``numpy<2``, onnxruntime …; see :mod:`tfgraph.runtime.serving.install`), not
tfgraph's: the config's ``python_paths`` parameter lists those, appended to ``sys.path`` with
``site.addsitedir`` (their ``.pth`` files run: an editable tfgraph) before tfgraph is
imported. Only the standard library is imported at the top of this file.
"""

import json
import os
import site
import sys
import threading
import time

PARAMETERS = {
    "stream": bool,
    "max_new_tokens": int,
    "do_sample": bool,
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "seed": int,
    "eos_token_id": int,
    "pad_token_id": int,
    "decoder_start_token_id": int,
}
SAMPLING = ("temperature", "top_k", "top_p")


class Job:
    """One request waiting for, or in, a batch."""

    def __init__(self, prompt, config, limit, seed, start, sender, stream=False, extra=None):
        self.prompt, self.config, self.limit, self.seed = prompt, config, limit, seed
        self.extra = extra  # a vision-language prompt's own inputs: a batch of its own
        self.start, self.sender, self.sent = start, sender, 0
        self.stream = stream  # a response per token; else one response with all of them
        self.tokens = []  # chosen so far (sent at the end when not streaming)
        self.request = None  # its SlotBatcher request, in-flight batching
        c = config  # requests with equal keys can share a batch
        self.key = (c.do_sample, c.temperature, c.top_k, c.top_p, c.eos_token_id,
                    c.pad_token_id, start)  # fmt: skip
        if extra is not None:
            self.key = (*self.key, id(self))


class RequestError(Exception):
    """A bad request: its message goes back to the client."""


# how each failure reaches the client: Triton's HTTP endpoints map the code to the status
BAD_REQUEST, FAILED, UNLOADED = "INVALID_ARG", "INTERNAL", "UNAVAILABLE"


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        for path in params.get("python_paths", "").split(os.pathsep):
            if path and path not in sys.path:
                site.addsitedir(path)  # appended: the stub's own packages come first
        import triton_python_backend_utils as pb_utils

        from tfgraph.runtime import CachedDecoder, open_runner
        from tfgraph.runtime.vision_language import ImagePrompts

        self.pb = pb_utils
        here = os.path.join(args["model_repository"], args["model_version"], "artifact")
        graph = os.path.join(here, "model.onnx")  # a vision-language artifact's: decoder/
        spinning = params.get("speculative") in (None, "", "prompt-lookup")  # else a draft's turn
        self.decoder = CachedDecoder(
            open_runner(graph if os.path.isfile(graph) else here, spinning=spinning)
        )
        self.images = None if os.path.isfile(graph) else ImagePrompts(here)
        self.tokenizer = None
        if os.path.isdir(os.path.join(here, "tokenizer")):
            from tfgraph.runtime.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(here)
        from tfgraph import contract

        logits = self.decoder.session.signature.output(contract.LOGITS)
        last = (logits.shape or [None])[-1] if logits is not None else None
        self.vocab = last if isinstance(last, int) else None
        # whether left-padded prompts are masked: else only equal lengths share a batch
        if self.decoder.seq2seq:
            roles = {p.role for p in self.decoder._all_inputs()}
            self.masks_padding = contract.ENCODER_ATTENTION_MASK in roles
        else:
            self.masks_padding = self.decoder.mask_input is not None
        self.max_rows = int(params.get("concurrency", "16"))
        self.wait_s = float(params.get("batch_wait_ms", "2")) / 1000
        self.pending = []  # Jobs in arrival order
        self.ready = threading.Condition()
        self.stopping = threading.Event()
        self.batcher = None
        schedule = self._schedule
        if params.get("batching") == "inflight":
            from tfgraph.runtime.inflight_speculative import make_batcher

            get, capacity = params.get, int(params.get("slot_capacity", "1024"))
            self.batcher = make_batcher(
                self.decoder, int(get("slots", str(self.max_rows))), capacity,
                encoder_capacity=int(get("encoder_capacity", str(capacity))),
                prefill_chunk=int(get("prefill_chunk", "0")),
                prefix_cache_bytes=int(float(get("prefix_cache_mb", "0")) * 2**20),
                speculative=get("speculative"), speculative_k=int(get("speculative_k", "4")),
            )  # fmt: skip
            schedule = self._schedule_inflight
        from tfgraph.runtime.serving.triton_metrics import Metrics

        self.metrics = Metrics(pb_utils, args["model_name"], self.batcher)
        self.worker = threading.Thread(target=schedule, daemon=True)
        self.worker.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self._prepare(request, sender)
            except RequestError as exc:
                self._fail(sender, str(exc), BAD_REQUEST)
                continue
            with self.ready:
                self.pending.append(job)
                self.ready.notify()
        return None

    def finalize(self):
        self.stopping.set()
        with self.ready:
            self.ready.notify()
        self.worker.join(timeout=60)
        for job in self.pending:
            self._fail(job.sender, "model unloaded before generating", UNLOADED)

    # --- a request ------------------------------------------------------------------------

    def _prepare(self, request, sender):
        """The request as a Job when it is valid; else RequestError with what is wrong."""
        from tfgraph.errors import TfgraphError
        from tfgraph.runtime import GenerationConfig

        options = self._parameters(request)
        ids = self.pb.get_input_tensor_by_name(request, "input_ids")
        text = self.pb.get_input_tensor_by_name(request, "text")
        if (ids is None) == (text is None):
            what = "text" if self.tokenizer is not None else "(no text: no tokenizer here)"
            raise RequestError(f"give exactly one prompt: input_ids or {what}")
        if text is not None:
            raw = text.as_numpy().reshape(-1)
            if raw.size != 1:
                raise RequestError(f"text takes one string, got {raw.size}")
            value = raw[0]
            try:
                value = value.decode("utf-8") if isinstance(value, bytes) else str(value)
            except UnicodeDecodeError as exc:
                raise RequestError(
                    f"text is not valid UTF-8 ({exc.reason} at byte {exc.start})"
                ) from None
            prompt, extra = self._text_prompt(request, value)
        else:
            prompt, extra = [int(t) for t in ids.as_numpy().reshape(-1)], None
            if self.pb.get_input_tensor_by_name(request, "image") is not None:
                raise RequestError("an image goes with a text prompt (the processor places it)")
        if not prompt:
            raise RequestError("the prompt is empty: give at least one token")
        if self.vocab is not None and any(not 0 <= t < self.vocab for t in prompt):
            raise RequestError(f"input_ids must lie in [0, {self.vocab}): the vocabulary")
        stream = options.pop("stream", False)
        start = options.pop("decoder_start_token_id", 0)
        seed = options.pop("seed", None)
        limit = options.pop("max_new_tokens", GenerationConfig.max_new_tokens)
        config = GenerationConfig(max_new_tokens=limit, **options)
        try:
            config.check()
            if self.batcher is not None:  # it must fit a slot
                self.batcher.check(prompt, config)
            length = 1 if self.decoder.seq2seq else len(prompt)
            self.decoder.check_positions(
                length + limit - 1, f"a {length}-token prompt with {limit} new tokens"
            )
        except TfgraphError as exc:
            raise RequestError(str(exc)) from exc
        return Job(prompt, config, limit, seed, start, sender, stream, extra)

    def _text_prompt(self, request, text: str):
        """(token ids, per-prompt inputs or None) of a text prompt; with the request's image
        (a vision-language artifact's), through the model's processor and vision graph."""
        from tfgraph.errors import TfgraphError
        from tfgraph.runtime.vision_language import open_image

        image = self.pb.get_input_tensor_by_name(request, "image")
        if image is None:
            return list(self.tokenizer(text)["input_ids"]), None
        raw = image.as_numpy().reshape(-1)
        if raw.size != 1:
            raise RequestError(f"image takes one image file's bytes, got {raw.size} items")
        try:
            ids, extra = self.images.prepare([text], [open_image(bytes(raw[0]))])
        except (TfgraphError, ValueError) as exc:
            raise RequestError(f"the image prompt was refused: {exc}") from None
        return ids[0], extra

    def _parameters(self, request) -> dict:
        try:
            given = json.loads(request.parameters() or "{}")
        except json.JSONDecodeError as exc:
            raise RequestError(f"request parameters are not JSON: {exc.msg}") from exc
        unknown = sorted(set(given) - set(PARAMETERS))
        if unknown:
            raise RequestError(
                f"unknown parameter(s) {', '.join(unknown)}: this model takes "
                + ", ".join(PARAMETERS)
            )
        options = {}
        for key, value in given.items():
            kind = PARAMETERS[key]
            if kind is bool:
                if not isinstance(value, bool):
                    raise RequestError(f"parameter {key} must be true or false, got {value!r}")
            elif kind is int:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise RequestError(f"parameter {key} must be an integer, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RequestError(f"parameter {key} must be a number, got {value!r}")
            options[key] = kind(value)
        if "do_sample" not in options and any(k in options for k in SAMPLING):
            options["do_sample"] = True
        return options

    # --- batches ------------------------------------------------------------------------

    def _schedule(self):
        while not self.stopping.is_set():
            with self.ready:
                while not self.pending and not self.stopping.is_set():
                    self.ready.wait()
                if self.stopping.is_set():
                    return
            time.sleep(self.wait_s)  # let requests that arrive together join
            with self.ready:
                batch = self._take()
            self._run(batch)

    def _take(self):
        """The oldest pending job and every pending job that can share its batch."""
        first = self.pending[0]
        batch, rest = [first], []
        limit = self.decoder.max_positions
        for job in self.pending[1:]:
            fits = len(batch) < self.max_rows and job.key == first.key
            if not self.masks_padding:
                fits = fits and len(job.prompt) == len(first.prompt)
            if fits and limit is not None and not self.decoder.seq2seq:
                width = max(len(j.prompt) for j in (*batch, job))
                fits = width + max(j.limit for j in (*batch, job)) - 1 <= limit
            (batch if fits else rest).append(job)
        self.pending[:] = rest
        return batch

    def _run(self, batch):
        from tfgraph.runtime import stream
        from tfgraph.runtime.generate import seq2seq_prompts

        first = batch[0].config
        prompts, extra = [job.prompt for job in batch], batch[0].extra or {}
        finished = set()
        try:
            if self.images is not None and not extra:  # text prompts: no image features
                extra = self.images.without_image(len(batch))
            if self.decoder.seq2seq:
                prompts, extra = seq2seq_prompts(
                    self.decoder, prompts, first.pad_token_id, batch[0].start
                )
            limits, seeds = [job.limit for job in batch], [job.seed for job in batch]
            steps = stream(self.decoder, prompts, first, extra=extra, limits=limits, seeds=seeds)
            for step in steps:
                if self.stopping.is_set():
                    for row, job in enumerate(batch):
                        if row not in finished:
                            self._fail(job.sender, "model unloaded while generating", UNLOADED)
                    return
                for row, token in step.tokens.items():
                    job = batch[row]
                    eos = first.eos_token_id is not None and token == first.eos_token_id
                    last = job.sent + 1 == job.limit or eos
                    self._emit(job, token, last)
                    if last:
                        finished.add(row)
        except Exception as exc:  # noqa: BLE001 - the clients hear of it, the server goes on
            for row, job in enumerate(batch):
                if row not in finished:
                    message = f"generation failed: {type(exc).__name__}: {exc}"
                    self._fail(job.sender, message, FAILED)

    # --- in-flight batching ------------------------------------------------------------

    def _schedule_inflight(self):
        batcher, jobs = self.batcher, {}  # jobs: slot -> Job
        while not self.stopping.is_set():
            with self.ready:
                while not self.pending and not jobs and not self.stopping.is_set():
                    self.ready.wait()
                if self.stopping.is_set():
                    break
                admit = self.pending[: batcher.free]
                del self.pending[: len(admit)]
            for job in admit:  # each joins the running batch in a free slot
                if self._cancelled(job):
                    self.metrics.count("cancelled")
                    continue
                try:
                    request = batcher.admit(job.prompt, job.config, job.seed, job.start, job.extra)
                except Exception as exc:  # noqa: BLE001 - this client hears of it
                    message = f"generation failed: {type(exc).__name__}: {exc}"
                    self._fail(job.sender, message, FAILED)
                    continue
                jobs[request.slot] = job
                job.request = request
                if request.tokens:  # else its first token comes from a step: chunked prefill
                    self._deliver(jobs, request.slot)
            if batcher.active:
                try:
                    tokens = batcher.step()
                except Exception as exc:  # noqa: BLE001 - the clients hear of it
                    message = f"generation failed: {type(exc).__name__}: {exc}"
                    for slot, job in list(jobs.items()):
                        batcher.release(slot)
                        self._fail(job.sender, message, FAILED)
                    jobs.clear()
                    continue
                for slot in tokens:
                    self._deliver(jobs, slot)
            for slot, job in list(jobs.items()):  # a client gone: its slot is free now
                if self._cancelled(job):
                    batcher.release(slot)
                    jobs.pop(slot)
                    self.metrics.count("cancelled")
            self.metrics.update(len(batcher.active), len(self.pending))
        for job in jobs.values():
            self._fail(job.sender, "model unloaded while generating", UNLOADED)

    def _deliver(self, jobs, slot):
        """Send the request in ``slot`` its tokens not sent yet (a step may give several);
        close its stream when it has ended; free the slot when its client cannot be reached."""
        job = jobs[slot]
        tokens, finished = job.request.tokens, job.request.finished
        try:
            while job.sent < len(tokens):
                self._emit(job, tokens[job.sent], finished and job.sent + 1 == len(tokens))
        except Exception:  # noqa: BLE001 - the client went away mid-stream
            self.batcher.release(slot)
            jobs.pop(slot)
            self.metrics.count("unreachable")
            return
        if job.request.finished:
            jobs.pop(slot)
            self.metrics.count("finished")

    @staticmethod
    def _cancelled(job) -> bool:
        is_cancelled = getattr(job.sender, "is_cancelled", None)
        try:
            return bool(is_cancelled()) if is_cancelled is not None else False
        except Exception:  # noqa: BLE001 - a sender that cannot tell is not cancelled
            return False

    def _emit(self, job, token: int, last: bool):
        """``token`` to its client: its own response when streaming, else kept for the one
        response that ``last`` sends with every token."""
        job.sent += 1
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if job.stream:
            job.sender.send(self._response([token]))
            if last:
                job.sender.send(flags=final)
            return
        job.tokens.append(token)
        if last:
            job.sender.send(self._response(job.tokens), flags=final)

    def _response(self, tokens: list):
        import numpy as np

        outputs = [self.pb.Tensor("token_id", np.array(tokens, np.int64))]
        if self.tokenizer is not None:  # these tokens' text
            text = self.tokenizer.decode(tokens)
            outputs.append(self.pb.Tensor("token_text", np.array([text.encode()], np.object_)))
        return self.pb.InferenceResponse(output_tensors=outputs)

    def _fail(self, sender, message: str, code: str = BAD_REQUEST):
        error = self.pb.TritonError
        code = getattr(error, code, None)
        failure = error(message) if code is None else error(message, code)
        final = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        sender.send(self.pb.InferenceResponse(error=failure), flags=final)
