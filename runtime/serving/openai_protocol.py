"""The OpenAI API's request bodies for ``tfgraph serve`` (pydantic models, as FastAPI reads
them) and the decoding settings they ask for.

Only what the server does is accepted: a field the OpenAI API has that the server cannot honour
(``n`` > 1, ``logprobs``, ``echo``, ``tools``, penalties other than 0 …) and any field the API
does not have is refused with a 400 naming it, as OpenAI's own server refuses an unknown
argument, rather than ignored. Two extensions, as vLLM spells them: ``top_k`` and
``return_token_ids`` (each choice then carries its ``token_ids``; the OpenAI client sends both
through ``extra_body``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tfgraph.runtime.generate import GenerationConfig

COMPLETION_DEFAULT_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
MAX_STOPS = 4  # OpenAI's limit on stop sequences


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # extension (vLLM): 0 takes every token
    n: Literal[1] = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    frequency_penalty: Literal[0] = 0
    presence_penalty: Literal[0] = 0
    logit_bias: Annotated[dict[str, float], Field(max_length=0)] | None = None
    return_token_ids: bool = False  # extension (vLLM): each choice carries its token_ids

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ValueError(f"stop takes up to {MAX_STOPS} non-empty strings")
        return stops

    @property
    def stops(self) -> list[str]:
        return list(self.stop or [])

    def generation(self, max_new_tokens: int, eos_token_id: int | None) -> GenerationConfig:
        """The runtime's decoding settings: temperature 0 is greedy, anything else samples
        (OpenAI's default temperature is 1)."""
        sample = self.temperature > 0
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=self.temperature if sample else 1.0,
            top_k=self.top_k if sample else 0,
            top_p=self.top_p if sample else 1.0,
            eos_token_id=eos_token_id,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: one prompt, as text or as token ids."""

    prompt: Prompt
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    logprobs: None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"one prompt per request, got {len(value)}")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str  # a data: URL (base64); remote URLs are refused (no network)
    detail: Literal["auto", "low", "high"] | None = None  # accepted, not used


class ImagePart(BaseModel):
    """An image content part: ``{"type": "image_url", "image_url": {"url": "data:…"}}``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageURL


Part = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class Message(BaseModel):
    """A chat message: text content (a string or parts: text, and images for a
    vision-language artifact)."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part]
    name: str | None = None

    @property
    def images(self) -> list[str]:
        """The URLs of its image parts."""
        if isinstance(self.content, str):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImagePart)]

    def as_template_input(self) -> dict:
        content = self.content
        if not isinstance(content, str):
            content = "".join(part.text for part in content if isinstance(part, TextPart))
        return {"role": self.role, "content": content}

    def as_processor_input(self) -> dict:
        """The message as a processor's chat template takes it: typed parts, an image part
        as ``{"type": "image"}`` (where the template writes the image token)."""
        parts = (
            [TextPart(type="text", text=self.content)]
            if isinstance(self.content, str)
            else self.content
        )
        content = [
            {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
            for p in parts
        ]
        return {"role": self.role, "content": content}


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: the messages go through the tokenizer's chat template."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Literal[False] | None = None

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
