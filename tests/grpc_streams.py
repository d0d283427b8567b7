"""One streamed request to a real Triton server over gRPC, shared by the serving tests: the
request's inputs (a tensor or text and an image), its tokens as they arrive and its error."""

import queue

import numpy as np


def stream_tokens(server, model: str, inputs: dict, **params) -> tuple[list[int], object]:
    """(tokens, error) of one streamed request of ``inputs`` (name → NumPy array: INT64 or
    BYTES) to ``model``; ``params``: the request's parameters (``stream`` is set)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    results = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    tensors = []
    for name, array in inputs.items():
        kind = "BYTES" if array.dtype == np.object_ else "INT64"
        tensor = grpcclient.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    params = {"stream": True, **params}  # a response per token
    client.async_stream_infer(model, tensors, parameters=params, enable_empty_final_response=True)
    tokens, error = [], None
    while True:
        result, error = results.get(timeout=120)
        if error is not None:
            break
        if result.get_response().parameters.get("triton_final_response").bool_param:
            break
        tokens.append(int(result.as_numpy("token_id")[0]))
    client.stop_stream()
    client.close()
    return tokens, error
