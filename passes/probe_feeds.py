"""Feeds for evaluating a mask or bias subgraph: every symbolic dimension given a distinct size
(``batch`` the batch), masks all ones (the last position zero with ``pad``), other inputs
filled with one token."""

from __future__ import annotations

import numpy as np
import onnx

SAMPLES_PER_FRAME = 400  # 25 ms of 16 kHz audio: more than any HF audio encoder's stride


def probe_feeds(graph: onnx.GraphProto, size: int, pad: bool, masks, token=0, batch=2) -> dict:
    dims: dict[str, int] = {}
    feeds = {}
    for inp in graph.input:
        shape = []
        for d in inp.type.tensor_type.shape.dim:
            if d.dim_param:
                if d.dim_param not in dims:
                    n = size + 2 * len(dims)
                    # raw audio: a feature extractor's strided convolutions (Moonshine's: 384
                    # samples a frame) leave nothing of a dozen samples
                    n = n * SAMPLES_PER_FRAME if d.dim_param == "samples" else n
                    dims[d.dim_param] = batch if d.dim_param == "batch" else n
                shape.append(dims[d.dim_param])
            else:
                shape.append(d.dim_value)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(inp.type.tensor_type.elem_type)
        if inp.name in masks:
            value = np.ones(shape, dtype=dtype)
            if pad and value.ndim >= 2:  # (B, S), or a 4-D mask fed as is (ONNX attn_mask)
                value[(-1,) * value.ndim] = 0
        else:
            value = np.full(shape, token, dtype=dtype)
        feeds[inp.name] = value
    return feeds
