"""A streaming client for the generation model (``NAME_generate``) over gRPC.

    for token, text in stream_tokens("127.0.0.1:8001", "llama_generate", [1, 2, 3],
                                     max_new_tokens=32, temperature=0.8, seed=0):
        ...

Each item is one response: the token id and, when the model has a tokenizer, its text piece
(else None). An error response raises :class:`tfgraph.errors.TfgraphError` with the server's
message.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence

import numpy as np

from tfgraph.errors import TfgraphError

TIMEOUT_S = 300  # for one response


def stream_tokens(
    url: str,
    model: str,
    input_ids: Sequence[int] | None = None,
    *,
    text: str | bytes | None = None,
    **parameters,
) -> Iterator[tuple[int, str | None]]:
    """Stream one request's tokens (``input_ids`` or ``text``; request ``parameters``): a
    response per token (``stream``: true)."""
    parameters = {**parameters, "stream": True}
    try:
        import tritonclient.grpc as grpcclient
    except (ImportError, RuntimeError) as exc:  # RuntimeError: tritonclient without [grpc]
        raise TfgraphError(
            "the client needs tritonclient with gRPC: pip install 'tritonclient[grpc]' "
            "(or 'tfgraph[serve]')"
        ) from exc
    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        inputs = []
        if input_ids is not None:
            ids = np.asarray(input_ids, dtype=np.int64)
            tensor = grpcclient.InferInput("input_ids", list(ids.shape), "INT64")
            tensor.set_data_from_numpy(ids)
            inputs.append(tensor)
        if text is not None:
            tensor = grpcclient.InferInput("text", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([text], dtype=np.object_))
            inputs.append(tensor)
        client.async_stream_infer(
            model, inputs, parameters=parameters, enable_empty_final_response=True
        )
        while True:
            result, error = results.get(timeout=TIMEOUT_S)
            if error is not None:
                raise TfgraphError(f"{model}: {error}")
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                return
            names = {o.name for o in response.outputs}
            piece = result.as_numpy("token_text")[0].decode() if "token_text" in names else None
            yield int(result.as_numpy("token_id")[0]), piece
    finally:
        client.stop_stream()
        client.close()
