"""One request's answer for ``tfgraph serve``: its tokens from the engine as text pieces, and
the OpenAI API's bodies and server-sent-event chunks built from them.

A streamed answer is ``data: {chunk}`` events ending with ``data: [DONE]``; an error after the
stream began (the response status already sent) is one ``data: {"error": …}`` event before
``[DONE]``, as vLLM sends it (the OpenAI client raises it as an ``APIError``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from tfgraph.runtime.serving.openai_engine import Job
from tfgraph.runtime.serving.openai_text import Detokenizer


class GenerationFailed(Exception):
    """The engine ended a request with an error (a failed step, a shutdown)."""


@dataclass
class Piece:
    """New text, the tokens that made it, and ``finish_reason`` on the last piece."""

    text: str
    tokens: list[int]
    finish_reason: str | None = None


async def pieces(job: Job, detokenizer: Detokenizer) -> AsyncIterator[Piece]:
    """The job's tokens as pieces of text until it ends: ``stop`` at EOS or a stop string,
    ``length`` at its ``max_new_tokens``. Leaving early (a stop string, a client gone: the
    consumer is closed) frees its slot at the next step."""
    eos = job.config.eos_token_id
    try:
        while True:
            event = await job.events.get()
            if event.error is not None:
                raise GenerationFailed(event.error)
            text = detokenizer.add(event.token)
            if detokenizer.stopped:
                yield Piece(text, [event.token], "stop")
                return
            if event.finished:
                reason = "stop" if eos is not None and event.token == eos else "length"
                yield Piece(text + detokenizer.flush(), [event.token], reason)
                return
            yield Piece(text, [event.token])
    finally:
        job.cancel()  # nothing when it has ended; else its slot is freed


@dataclass
class Answer:
    """What one request's response says about itself."""

    model: str
    chat: bool
    prompt_tokens: int
    return_token_ids: bool = False
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def _head(self, object_name: str) -> dict:
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.id, "object": object_name, "created": self.created,
                "model": self.model}  # fmt: skip

    def usage(self, completion_tokens: int) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def _choice(self, text: str, tokens: list[int], reason: str | None, delta: bool) -> dict:
        if not self.chat:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        elif delta:
            choice = {"index": 0, "delta": {"content": text} if text else {},
                      "logprobs": None, "finish_reason": reason}  # fmt: skip
        else:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": reason}
        if self.return_token_ids:
            choice["token_ids"] = tokens
        return choice

    def body(self, text: str, tokens: list[int], reason: str) -> dict:
        """The whole (non-streamed) response."""
        return {
            **self._head(self.object),
            "choices": [self._choice(text, tokens, reason, delta=False)],
            "usage": self.usage(len(tokens)),
        }

    def chunk(self, text: str, tokens: list[int], reason: str | None = None) -> dict:
        name = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(name), "choices": [self._choice(text, tokens, reason, delta=True)]}

    def first_chunk(self) -> dict | None:
        """A chat stream opens with the assistant's role."""
        if not self.chat:
            return None
        chunk = self.chunk("", [])
        chunk["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        chunk["choices"][0].pop("token_ids", None)
        return chunk


async def collect(job: Job, detokenizer: Detokenizer, answer: Answer) -> dict:
    """The non-streamed response body."""
    text, tokens, reason = [], [], "length"
    async for piece in pieces(job, detokenizer):
        text.append(piece.text)
        tokens += piece.tokens
        reason = piece.finish_reason or reason
    return answer.body("".join(text), tokens, reason)


def _event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def events(job: Job, detokenizer: Detokenizer, answer: Answer) -> AsyncIterator[str]:
    """The server-sent events of a streamed response, ``data: [DONE]`` last."""
    first = answer.first_chunk()
    if first is not None:
        yield _event(first)
    count = 0
    try:
        async for piece in pieces(job, detokenizer):
            count += len(piece.tokens)
            if piece.text or answer.return_token_ids:
                yield _event(answer.chunk(piece.text, piece.tokens))
            if piece.finish_reason is not None:
                yield _event(answer.chunk("", [], piece.finish_reason))
        if answer.include_usage:
            usage = {**answer.chunk("", []), "choices": [], "usage": answer.usage(count)}
            yield _event(usage)
    except GenerationFailed as exc:
        yield _event({"error": {"message": str(exc), "type": "server_error", "code": 500}})
    yield _event("[DONE]")
