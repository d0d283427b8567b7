"""Text in and out of ``tfgraph serve``: prompts through the artifact's tokenizer, chat
messages through its chat template, tokens back to text as they come, and stop strings.

Chat messages are rendered by the tokenizer's own ``apply_chat_template`` (the Jinja template
in ``tokenizer/tokenizer_config.json`` or ``chat_template.jinja``, with the generation prompt
added) and the rendered text is tokenized without adding special tokens again (the template
writes them). A tokenizer without a template is refused with a 400: there is no fallback
format, since a model answers well only in the format it was trained on.

A vision-language artifact's chat messages may hold an image (an ``image_url`` part with a
``data:`` URL; a remote URL is refused: the server fetches nothing): they are rendered by the
processor's own chat template (which writes the image token where the image part is) and go,
with the image, through :meth:`tfgraph.runtime.vision_language.ImagePrompts.prepare`, as
``tfgraph.load(DIR).generate(text, image=…)`` takes them.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence

from tfgraph.errors import TfgraphError, first_line


class RequestError(TfgraphError):
    """A request the server cannot serve as asked: a 4xx with this message."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def encode_prompt(tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """Token ids of a completion prompt: ids as given, text through the tokenizer (with its
    special tokens, as ``tfgraph generate --text`` encodes it)."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if tokenizer is None:
        raise RequestError(
            "this artifact carries no tokenizer: give the prompt as token ids", param="prompt"
        )
    ids = list(tokenizer(prompt)["input_ids"])
    if not ids:
        raise RequestError("the prompt encodes to no tokens", param="prompt")
    return ids


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of chat ``messages`` rendered by the tokenizer's chat template."""
    if tokenizer is None:
        raise RequestError(
            "this artifact carries no tokenizer, so no chat template: use /v1/completions "
            "with token ids",
            param="messages",
        )
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(
            "the model's tokenizer has no chat template (chat_template in "
            "tokenizer_config.json): use /v1/completions with the prompt written out",
            param="messages",
        )
    text = _render(tokenizer, messages)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not ids:
        raise RequestError("the chat template rendered no tokens", param="messages")
    return ids


def decode_image(url: str):
    """The PIL image of a ``data:image/…;base64,…`` URL; any other URL is refused in one line."""
    from PIL import Image, UnidentifiedImageError

    if url.startswith(("http://", "https://")):
        raise RequestError(
            "image_url: remote URLs are not fetched (this server uses no network); send the "
            "image inline as a data: URL (data:image/png;base64,...)",
            param="messages",
        )
    head, comma, data = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64") and comma):
        raise RequestError(
            "image_url: give a data URL of a base64 image (data:image/png;base64,...)",
            param="messages",
        )
    try:
        raw = base64.b64decode(data, validate=True)
        with Image.open(io.BytesIO(raw)) as image:
            return image.convert("RGB")
    except (binascii.Error, ValueError, OSError, UnidentifiedImageError) as exc:
        raise RequestError(
            f"image_url: not a readable base64 image ({first_line(exc)})", param="messages"
        ) from None


def image_chat_text(processor, messages: list[dict]) -> str:
    """Chat ``messages`` (the processor's form: typed parts) rendered by the processor's chat
    template; a leading BOS the processor adds again is left to it (as Hugging Face's
    ``apply_chat_template(tokenize=True)`` tokenizes such a text without special tokens)."""
    if not getattr(processor, "chat_template", None):
        raise RequestError(
            "the model's processor has no chat template (chat_template.jinja in processor/), "
            "so images cannot be placed in chat messages; use /v1/chat/completions without "
            "images or tfgraph generate --image",
            param="messages",
        )
    text = _render(processor, messages)
    tokenizer = processor.tokenizer
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and tokenizer.bos_token_id in tokenizer("")["input_ids"]:
        text = text[len(bos) :]
    return text


class Detokenizer:
    """A request's new tokens as text, released as soon as it is final.

    Each token re-decodes the request's tokens (special tokens skipped) and releases what
    is new, holding back a trailing incomplete character (U+FFFD: a multi-byte character
    split across tokens) and, with stop strings, the last ``len(longest stop) - 1``
    characters, which could start a stop string. A stop string ends the text before it
    (it is not returned), as OpenAI's API does.
    """

    def __init__(self, tokenizer, stops: Sequence[str] = ()):
        self.tokenizer, self.stops = tokenizer, list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0  # characters of self.text released
        self.stopped = False  # a stop string matched

    def add(self, token: int) -> str:
        """The text ``token`` makes final (may be empty)."""
        self.tokens.append(token)
        if self.tokenizer is None:
            return ""
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = self._stop_at()
        if cut is not None:
            self.stopped = True
            self.text = self.text[:cut]
            return self._release(cut)
        return self._release(len(self.text.rstrip("\ufffd")) - self.hold)

    def flush(self) -> str:
        """What is left at the end of the request."""
        return self._release(len(self.text))

    def _stop_at(self) -> int | None:
        start = max(0, self.sent - self.hold)
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        piece = self.text[self.sent : end]
        self.sent = end
        return piece


def _render(owner, messages: list) -> str:
    """The chat template of ``owner`` (a tokenizer or a processor) applied to ``messages``
    with the generation prompt; a template that refuses them is the request's error."""
    try:
        return owner.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - the template refused these messages (Jinja)
        raise RequestError(f"the chat template refused the messages: {first_line(exc)}") from exc
