"""``tfgraph serve DIR``: an OpenAI-compatible HTTP server over a KV-cached artifact, on
FastAPI and uvicorn, its requests batched in flight (:mod:`.openai_engine`).

Endpoints: ``GET /v1/models`` (the one model, its slot capacity as ``max_model_len``),
``POST /v1/completions``, ``POST /v1/chat/completions`` (the messages through the tokenizer's
chat template; for a vision-language artifact, a message may hold one image as a ``data:`` URL:
the processor's chat template and the model's own processor place it, the vision graph runs
off the event loop), ``GET /health``. ``"stream": true`` answers with server-sent events ending
with ``data: [DONE]``. Errors are JSON in the OpenAI API's shape,
``{"error": {"message", "type", "param", "code"}}``: a malformed body, a field the server does
not take, a prompt too long for a slot → 400; another model's name, an unknown path → 404; a
failed generation → 500.
"""

import asyncio
import logging
import socket
import time
from pathlib import Path

from tfgraph.errors import TfgraphError
from tfgraph.runtime.serving.openai_engine import Engine
from tfgraph.runtime.serving.openai_protocol import (
    COMPLETION_DEFAULT_TOKENS,
    ChatRequest,
    CompletionRequest,
)
from tfgraph.runtime.serving.openai_stream import Answer, GenerationFailed, collect, events
from tfgraph.runtime.serving.openai_text import (
    Detokenizer,
    RequestError,
    chat_prompt,
    decode_image,
    encode_prompt,
    image_chat_text,
)

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 422: "invalid_request_error"}


def error_body(status: int, message: str, param: str | None = None, code=None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _validation_message(errors) -> tuple[str, str | None]:
    """One line from pydantic's errors, and the field it is about."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    field = loc[0] if loc else None
    where = ".".join(loc) or "the body"
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({first.get('msg')})", None
    if first.get("type") == "extra_forbidden":
        return f"unsupported field '{where}': tfgraph serve does not take it", field
    if first.get("type") == "missing":
        return f"'{where}' is required", field
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first.get('msg')}{more}", field


def create_app(engine: Engine, tokenizer, name: str):
    """The FastAPI application serving ``engine`` as model ``name``."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="tfgraph serve", docs_url=None, redoc_url=None)
    eos = getattr(tokenizer, "eos_token_id", None)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc.errors())
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def _http(_request: Request, exc: HTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code)

    @app.exception_handler(TfgraphError)
    async def _refused(_request: Request, exc: TfgraphError):
        status = getattr(exc, "status", 400)
        body = error_body(status, str(exc), getattr(exc, "param", None))
        return JSONResponse(body, status_code=status)

    @app.exception_handler(GenerationFailed)
    async def _failed(_request: Request, exc: GenerationFailed):
        return JSONResponse(error_body(500, str(exc)), status_code=500)

    def card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "tfgraph",
                "max_model_len": engine.capacity}  # fmt: skip

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        _check_model(model, name)
        return card()

    def start(request, prompt: list[int], limit: int | None, chat: bool, extra=None):
        """Check and queue a request; its answer (streamed or whole) as a response."""
        _check_model(request.model, name)
        limit = limit or max(1, engine.capacity - len(prompt) + 1)
        try:
            job = engine.submit(prompt, request.generation(limit, eos), request.seed, extra)
        except TfgraphError as exc:
            raise RequestError(str(exc)) from None
        detokenizer = Detokenizer(tokenizer, request.stops)
        answer = Answer(name, chat, len(prompt), request.return_token_ids, request.include_usage)
        if request.stream:
            return StreamingResponse(
                events(job, detokenizer, answer), media_type="text/event-stream"
            )
        return collect(job, detokenizer, answer)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        prompt = encode_prompt(tokenizer, request.prompt)
        limit = request.max_tokens or COMPLETION_DEFAULT_TOKENS
        answer = start(request, prompt, limit, chat=False)
        return answer if isinstance(answer, StreamingResponse) else await answer

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest):
        _check_model(request.model, name)
        prompt, extra = await chat_inputs(engine, tokenizer, request.messages)
        answer = start(request, prompt, request.limit, chat=True, extra=extra)
        return answer if isinstance(answer, StreamingResponse) else await answer

    return app


async def chat_inputs(engine: Engine, tokenizer, messages) -> tuple[list[int], dict | None]:
    """(token ids, the decoder's per-prompt inputs or None) of chat ``messages``: through the
    tokenizer's chat template, or, holding an image, :func:`image_prompt` off the event loop
    (the processor and the vision graph take a while)."""
    if any(m.images for m in messages):
        return await asyncio.to_thread(image_prompt, engine, messages)
    return chat_prompt(tokenizer, [m.as_template_input() for m in messages]), None


def image_prompt(engine: Engine, messages) -> tuple[list[int], dict]:
    """(token ids, the decoder's per-prompt inputs) of chat ``messages`` holding one image:
    the processor's chat template, then the model's processor and the vision graph."""
    urls = [url for m in messages for url in m.images]
    if engine.images is None:
        raise RequestError(
            "this model takes no images (the artifact has no vision graph): send text only",
            param="messages",
        )
    if len(urls) > 1:
        raise RequestError(
            f"{len(urls)} images in one request: this server takes one image per request",
            param="messages",
        )
    image = decode_image(urls[0])
    text = image_chat_text(engine.images.processor, [m.as_processor_input() for m in messages])
    try:
        ids, extra = engine.images.prepare([text], [image])
    except (TfgraphError, ValueError) as exc:  # the processor refused text and image
        raise RequestError(f"the processor refused the prompt: {exc}", param="messages") from exc
    return ids[0], extra


def _check_model(asked: str | None, name: str) -> None:
    if asked is not None and asked != name:
        raise RequestError(
            f"the model '{asked}' does not exist here: this server serves '{name}'",
            status=404,
            param="model",
        )


def open_engine(path: str | Path, **options):
    """The engine and the tokenizer (None when the artifact carries none) of ``path``."""
    from tfgraph.runtime.tokenizer import load_tokenizer

    path = Path(path)
    if not path.is_dir():
        raise TfgraphError(f"'{path}' is not a directory: give an artifact (tfgraph export's)")
    tokenizer = load_tokenizer(path) if (path / "tokenizer").is_dir() else None
    return Engine(path, **options), tokenizer


def server(app, host: str = "127.0.0.1", port: int = 8000, verbose: bool = False):
    """A uvicorn server for ``app`` (not started: ``.run()``)."""
    try:
        import uvicorn
    except ImportError as exc:
        raise TfgraphError("tfgraph serve needs uvicorn: pip install 'tfgraph[serve]'") from exc
    config = uvicorn.Config(
        app, host=host, port=port, log_level="info" if verbose else "warning",
        access_log=verbose, timeout_graceful_shutdown=5,
    )  # fmt: skip
    return uvicorn.Server(config)


def bound_socket(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (port 0: a free one), or a one-line error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise TfgraphError(
            f"cannot listen on {host}:{port} ({exc.strerror}); choose another --port"
        ) from None
    sock.listen(128)  # clients that come before the server starts wait in the backlog
    return sock
