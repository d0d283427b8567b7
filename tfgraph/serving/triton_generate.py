"""Triton Python-backend model: tfgraph's generation loop over an artifact, tokens streamed.

:mod:`tfgraph.serving.repository` copies this file as ``model.py`` into ``NAME_generate/1/``
beside a copy of the artifact (``artifact/``). The model is decoupled: every chosen token goes
back as its own response (``token_id``, and ``token_text`` when the artifact carries a
tokenizer), then an empty final response closes the stream.

**Requests.** ``input_ids`` (INT64, one prompt) or ``text`` (a UTF-8 string, with a tokenizer);
an encoder-decoder's prompt feeds its encoder. Request parameters: ``max_new_tokens``,
``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``eos_token_id`` (and
``pad_token_id``, ``decoder_start_token_id``); ``temperature``, ``top_k`` or ``top_p`` imply
sampling unless ``do_sample`` is false. Anything else is refused with one error response
naming what was wrong; the server keeps serving.

**Concurrency.** ``execute`` checks each request and hands it to a thread, so requests that
arrive together decode at the same time, up to the config's ``concurrency`` (more wait for a
slot), each with its own KV cache, all through one ONNX Runtime session. Requests are not
stacked into one batch tensor: each row's numbers (and a seeded sample) are then exactly those
of ``tfgraph generate`` on that prompt alone.

**Unloading** while streams are in flight: ``finalize`` asks them to stop; each ends with an
error response ("model unloaded while generating") and its final flag.

The Python backend's stub does not see a virtual environment's site-packages: the config's
``python_paths`` parameter lists them, added to ``sys.path`` before anything else is imported.
Only the standard library is imported at the top of this file.
"""

import json
import os
import sys
import threading

PARAMETERS = {
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


class RequestError(Exception):
    """A bad request: its message goes back to the client."""


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        for path in params.get("python_paths", "").split(os.pathsep):
            if path and path not in sys.path:
                sys.path.append(path)
        import triton_python_backend_utils as pb_utils

        from tfgraph.runtime import CachedDecoder, open_runner

        self.pb = pb_utils
        here = os.path.join(args["model_repository"], args["model_version"], "artifact")
        self.decoder = CachedDecoder(open_runner(os.path.join(here, "model.onnx")))
        self.tokenizer = None
        if os.path.isdir(os.path.join(here, "tokenizer")):
            from tfgraph.runtime.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(here)
        from tfgraph import contract

        logits = self.decoder.session.signature.output(contract.LOGITS)
        last = (logits.shape or [None])[-1] if logits is not None else None
        self.vocab = last if isinstance(last, int) else None
        self.slots = threading.BoundedSemaphore(int(params.get("concurrency", "16")))
        self.stopping = threading.Event()
        self.threads = set()
        self.lock = threading.Lock()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                job = self._prepare(request)
            except RequestError as exc:
                self._fail(sender, str(exc))
                continue
            thread = threading.Thread(target=self._serve, args=(job, sender), daemon=True)
            with self.lock:
                self.threads.add(thread)
            thread.start()
        return None

    def finalize(self):
        self.stopping.set()
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=30)

    # --- a request ------------------------------------------------------------------------

    def _prepare(self, request):
        """(the decoding stream, whether to send text) for a valid request; else RequestError
        with what is wrong."""
        from tfgraph.errors import TfgraphError
        from tfgraph.runtime import GenerationConfig, stream
        from tfgraph.runtime.generate import seq2seq_prompts

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
            prompt = list(self.tokenizer(value)["input_ids"])
        else:
            prompt = [int(t) for t in ids.as_numpy().reshape(-1)]
        if not prompt:
            raise RequestError("the prompt is empty: give at least one token")
        start = options.pop("decoder_start_token_id", 0)
        config = GenerationConfig(**options)
        extra = {}
        prompts = [prompt]
        if self.vocab is not None and any(not 0 <= t < self.vocab for t in prompt):
            raise RequestError(f"input_ids must lie in [0, {self.vocab}): the vocabulary")
        try:
            if self.decoder.seq2seq:
                prompts, extra = seq2seq_prompts(self.decoder, prompts, config.pad_token_id, start)
            steps = stream(self.decoder, prompts, config, extra=extra)
        except TfgraphError as exc:
            raise RequestError(str(exc)) from exc
        return steps

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

    # --- streaming ------------------------------------------------------------------------

    def _serve(self, job, sender):
        steps = job
        try:
            with self.slots:
                for step in steps:
                    if self.stopping.is_set():
                        self._fail(sender, "model unloaded while generating")
                        return
                    for token in step.tokens.values():
                        sender.send(self._response(token))
            sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # noqa: BLE001 - the client hears of it, the server goes on
            self._fail(sender, f"generation failed: {type(exc).__name__}: {exc}")
        finally:
            with self.lock:
                self.threads.discard(threading.current_thread())

    def _response(self, token: int):
        import numpy as np

        outputs = [self.pb.Tensor("token_id", np.array([token], np.int64))]
        if self.tokenizer is not None:  # this token's piece of text
            piece = self.tokenizer.decode([token])
            outputs.append(self.pb.Tensor("token_text", np.array([piece.encode()], np.object_)))
        return self.pb.InferenceResponse(output_tensors=outputs)

    def _fail(self, sender, message: str):
        sender.send(
            self.pb.InferenceResponse(error=self.pb.TritonError(message)),
            flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
        )
