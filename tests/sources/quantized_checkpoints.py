"""Tiny AWQ and GPTQ checkpoints written here, without autoawq, gptqmodel or a download.

:func:`write` takes a tiny random Llama, quantizes each decoder Linear's weight round-to-nearest
per group of input rows (asymmetric, or GPTQ's symmetric zero point 8) with plain numpy, and
writes the directory those libraries ship: ``qweight`` / ``qzeros`` / ``scales`` (``g_idx`` for
GPTQ) int32-packed as they pack them, the rest of the weights in fp16, and ``config.json``'s
``quantization_config``. It returns each quantized Linear's dequantized (N, K) fp32 weight: what
a reader of the directory must compute. The packing is written from the libraries' layouts
(AutoAWQ's ``pack`` with its 0, 2, 4, 6, 1, 3, 5, 7 nibble order; AutoGPTQ's ``pack`` with
zero points stored minus one), not from tfgraph's reader; the tests check it against
onnxruntime-genai's own readers of these formats.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack: nibble i of a word ← column order[i]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def tiny_llama(seed: int = 0, layers: int = 2):
    """A random Llama small enough to export in seconds (hidden 64, 4 heads, 2 KV heads)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def rtn(weight: np.ndarray, group: int, *, sym: bool, perm: np.ndarray | None = None):
    """Round-to-nearest 4-bit of a (N, K) weight in groups of ``group`` input rows (the rows
    ``perm[g*group:(g+1)*group]`` with ``perm``, GPTQ's act-order): ``(q (K, N), scales (G, N)
    fp16, zeros (G, N), g_idx (K,))``. The scale is rounded to fp16 before the integers are
    taken, as the shipped scales are fp16."""
    w = weight.T.astype(np.float32)  # (K, N)
    k, n = w.shape
    perm = np.arange(k) if perm is None else perm
    g_idx = np.empty(k, dtype=np.int32)
    g_idx[perm] = np.arange(k) // group
    groups = k // group
    q = np.empty((k, n), dtype=np.uint8)
    scales = np.empty((groups, n), dtype=np.float16)
    zeros = np.empty((groups, n), dtype=np.uint8)
    for g in range(groups):
        rows = w[g_idx == g]
        lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
        if sym:
            hi = np.maximum(-lo, hi)
            lo = -hi
        scale = ((hi - lo) / 15).astype(np.float16)
        scale[scale == 0] = 1
        s = scale.astype(np.float32)
        zero = np.full(n, 8.0) if sym else np.clip(np.round(-lo / s), 0, 15)
        q[g_idx == g] = np.clip(np.round(rows / s) + zero, 0, 15).astype(np.uint8)
        scales[g], zeros[g] = scale, zero.astype(np.uint8)
    return q, scales, zeros, g_idx


def dequantized(q, scales, zeros, g_idx) -> np.ndarray:
    """(N, K) fp32 ``(q − z) · s`` of each row's group."""
    s = scales.astype(np.float32)[g_idx]  # (K, N)
    return ((q.astype(np.float32) - zeros.astype(np.float32)[g_idx]) * s).T.copy()


def _words_along_rows(values: np.ndarray) -> np.ndarray:
    """(R*8, C) 4-bit values → (R, C) int32, value 8r+j in bits 4j (AutoGPTQ's qweight)."""
    v = values.astype(np.uint32).reshape(-1, 8, values.shape[1])
    out = np.zeros((v.shape[0], v.shape[2]), dtype=np.uint32)
    for j in range(8):
        out |= v[:, j, :] << np.uint32(4 * j)
    return out.view(np.int32)


def _words_along_columns(values: np.ndarray, order=tuple(range(8))) -> np.ndarray:
    """(R, C*8) 4-bit values → (R, C) int32, column 8c+order[i] in bits 4i (AutoAWQ's
    qweight and qzeros with AWQ_ORDER, AutoGPTQ's qzeros in order)."""
    v = values.astype(np.uint32)
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for i, column in enumerate(order):
        out |= v[:, column::8] << np.uint32(4 * i)
    return out.view(np.int32)


def _packed(method: str, q, scales, zeros, g_idx) -> dict[str, torch.Tensor]:
    if method == "awq":
        return {
            "qweight": torch.from_numpy(_words_along_columns(q, AWQ_ORDER)),
            "qzeros": torch.from_numpy(_words_along_columns(zeros, AWQ_ORDER)),
            "scales": torch.from_numpy(scales),
        }
    stored = (zeros.astype(np.int32) - 1) & 0xF  # AutoGPTQ's historical offset
    return {
        "qweight": torch.from_numpy(_words_along_rows(q)),
        "qzeros": torch.from_numpy(_words_along_columns(stored)),
        "scales": torch.from_numpy(scales),
        "g_idx": torch.from_numpy(g_idx),
    }


def quantization_config(method: str, group: int, *, desc_act: bool, sym: bool) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                "zero_point": True}  # fmt: skip
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
            "sym": sym, "checkpoint_format": "gptq", "damp_percent": 0.01,
            "true_sequential": True}  # fmt: skip


def write(
    directory: Path, method: str, *, group: int = 32, desc_act: bool = False,
    sym: bool = False, seed: int = 0, layers: int = 2,
) -> dict[str, np.ndarray]:  # fmt: skip
    """Write a tiny ``method`` ("awq" | "gptq") checkpoint to ``directory``; each quantized
    Linear's (N, K) dequantized fp32 weight by its ``<prefix>.weight`` name."""
    from safetensors.torch import save_file

    model = tiny_llama(seed, layers)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, np.ndarray] = {}
    quantized = {f"model.layers.{i}.{name}" for i in range(layers) for name in LINEARS}
    for name, value in model.state_dict().items():
        prefix = name.removesuffix(".weight")
        if prefix not in quantized:
            tensors[name] = value.to(torch.float16).contiguous()
            continue
        weight = value.numpy()
        perm = rng.permutation(weight.shape[1]) if desc_act else None
        q, scales, zeros, g_idx = rtn(weight, group, sym=sym and method == "gptq", perm=perm)
        expected[name] = dequantized(q, scales, zeros, g_idx)
        for part, packed in _packed(method, q, scales, zeros, g_idx).items():
            tensors[f"{prefix}.{part}"] = packed.contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.update(
        architectures=["LlamaForCausalLM"], torch_dtype="float16",
        quantization_config=quantization_config(method, group, desc_act=desc_act, sym=sym),
    )  # fmt: skip
    config.pop("dtype", None)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return expected
