"""AWQ and GPTQ checkpoints, read as they ship: the eager model dequantized, the shipped
integers kept for ``MatMulNBits``.

A Hugging Face directory whose ``config.json`` has a ``quantization_config`` with
``quant_method`` ``awq`` (AutoAWQ's GEMM layout) or ``gptq`` (AutoGPTQ / GPTQModel) stores each
quantized ``Linear`` as int32-packed tensors instead of ``weight`` (K: input features, N:
outputs, G: groups along K):

- **AWQ GEMM**: ``qweight`` (K, N/8) and ``qzeros`` (G, N/8), eight 4-bit values per word
  along N in the order 0, 2, 4, 6, 1, 3, 5, 7 (nibble ``i`` holds column ``_AWQ_ORDER[i]``);
  ``scales`` (G, N); the weight is ``(q − z) · s``;
- **GPTQ**: ``qweight`` (K/8, N), eight values per word along K in order; ``qzeros`` (G, N/8)
  along N in order, stored as ``z − 1`` in the historical (v1, ``checkpoint_format`` "gptq")
  layout, ``z`` in "gptq_v2"; ``scales`` (G, N); ``g_idx`` (K,) the group of each input row
  (``k // group_size`` unless ``desc_act`` reordered the rows).

transformers cannot load these without autoawq / gptqmodel. :class:`QuantizedCheckpoint` is a
:class:`~tfgraph.sources.checkpoint.Checkpoint` that also names ``<prefix>.weight`` for each
quantized ``<prefix>``: read, it is dequantized to fp32 from that Linear's four tensors alone,
so the model built from the config without its ``quantization_config`` (plain Linears) streams
as any checkpoint does, and is the exact eager reference of the shipped integers.

The lazy tensor of such a weight carries :data:`SHIPPED` (a :class:`Shipped`): the int4 weights
stage (:func:`shipped_blocks`) writes the checkpoint's own integers, scales and zero points in
``MatMulNBits``' layout instead of quantizing the dequantized weight again.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tfgraph.errors import TfgraphError
from tfgraph.sources.checkpoint import Checkpoint, Entry

logger = logging.getLogger(__name__)

SHIPPED = "tfgraph.shipped_quantized"  # lazy tensor meta: the Shipped integers of a weight
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column _AWQ_ORDER[i]
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass(frozen=True)
class Format:
    """A checkpoint's ``quantization_config``, as tfgraph reads it."""

    method: str  # "awq" | "gptq"
    bits: int
    group_size: int  # -1: one group over all of K
    desc_act: bool = False
    sym: bool = False
    zero_offset: int = 0  # added to a stored zero point (GPTQ v1 stores z − 1)

    @property
    def label(self) -> str:
        return f"{self.method} checkpoint"

    def describe(self) -> dict:
        return {
            "format": self.label,
            "bits": self.bits,
            "group_size": self.group_size,
            **({"desc_act": self.desc_act, "sym": self.sym} if self.method == "gptq" else {}),
        }


def detect(path: Path) -> Format | None:
    """The AWQ / GPTQ format ``path/config.json`` declares, ``None`` for a checkpoint without
    a ``quantization_config`` of those methods; one of them tfgraph cannot read is refused."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the Hugging Face loader reports an unreadable config
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    method = str((quant or {}).get("quant_method", "")).lower()
    if method not in ("awq", "gptq"):
        return None
    bits = int(quant.get("bits", quant.get("w_bit", 4)))
    group = int(quant.get("group_size", quant.get("q_group_size", 128)))
    if bits != 4:
        raise TfgraphError(
            f"'{path}' is a {bits}-bit {method.upper()} checkpoint: tfgraph reads 4-bit AWQ and "
            "GPTQ checkpoints only; export the unquantized model with --weights instead"
        )
    if method == "awq":
        version = str(quant.get("version", "gemm")).lower()
        if version != "gemm" or not quant.get("zero_point", True):
            raise TfgraphError(
                f"'{path}' is an AWQ checkpoint in the '{version}' layout"
                f"{'' if quant.get('zero_point', True) else ' without zero points'}: tfgraph "
                "reads AutoAWQ's GEMM layout with zero points (version: gemm) only"
            )
        return Format("awq", bits, group)
    layout = str(quant.get("checkpoint_format", "gptq")).lower()
    if layout not in ("gptq", "gptq_v2"):
        raise TfgraphError(
            f"'{path}' is a GPTQ checkpoint in the '{layout}' layout: tfgraph reads the gptq "
            "and gptq_v2 layouts only (re-save it with GPTQModel's default format)"
        )
    return Format(
        "gptq", bits, group, bool(quant.get("desc_act", False)), bool(quant.get("sym", True)),
        zero_offset=1 if layout == "gptq" else 0,
    )  # fmt: skip


# --- the formats -----------------------------------------------------------------------------


def _nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words → their eight 4-bit values in order, spread along ``axis`` (0 or 1)."""
    raw = np.ascontiguousarray(words).view(np.uint32)
    shifts = np.arange(0, 32, 4, dtype=np.uint32)
    if axis == 0:  # (R, C) → (R*8, C)
        out = (raw[:, None, :] >> shifts[None, :, None]) & 0xF
        return out.reshape(raw.shape[0] * 8, raw.shape[1]).astype(np.uint8)
    out = (raw[:, :, None] >> shifts[None, None, :]) & 0xF  # (R, C) → (R, C*8)
    return out.reshape(raw.shape[0], raw.shape[1] * 8).astype(np.uint8)


def _awq_columns(values: np.ndarray) -> np.ndarray:
    """AWQ's nibble order undone: column ``8c + _AWQ_ORDER[i]`` is nibble ``8c + i``."""
    rows, width = values.shape
    out = np.empty_like(values)
    out.reshape(rows, width // 8, 8)[:, :, list(_AWQ_ORDER)] = values.reshape(rows, width // 8, 8)
    return out


def unpack(fmt: Format, qweight, qzeros, scales, g_idx=None) -> tuple:
    """One Linear's shipped tensors (numpy or torch) → ``(q (K, N) uint8, scales (N, G)
    float32, zero points (N, G) uint8, groups)``: ``groups`` the (K,) group of each input row
    where ``g_idx`` is not simply ``k // group_size``, else ``None``."""
    qweight, qzeros = _numpy(qweight).astype(np.int32), _numpy(qzeros).astype(np.int32)
    scales = _numpy(scales).astype(np.float32)
    n = scales.shape[1]
    if fmt.method == "awq":
        q = _awq_columns(_nibbles(qweight, 1))
        zeros = _awq_columns(_nibbles(qzeros, 1))
    else:
        q = _nibbles(qweight, 0)
        zeros = _nibbles(qzeros, 1)
        zeros = ((zeros.astype(np.int32) + fmt.zero_offset) & 0xF).astype(np.uint8)
    q, zeros = q[:, :n], zeros[:, :n]
    k = q.shape[0]
    groups = None
    if g_idx is not None:
        g_idx = _numpy(g_idx).astype(np.int64)
        size = k // scales.shape[0] if fmt.group_size == -1 else fmt.group_size
        if not np.array_equal(g_idx, np.arange(k) // size):
            groups = g_idx
    return q, np.ascontiguousarray(scales.T), np.ascontiguousarray(zeros.T), groups


def dequantize(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray, groups=None) -> np.ndarray:
    """The (N, K) fp32 weight of a Linear: ``(q − z) · s`` of each row's group (``groups``: the
    group of each input row; ``None``: consecutive rows of K / G)."""
    k = q.shape[0]
    if groups is None:
        groups = np.arange(k) // -(-k // scales.shape[1])
    z = zeros[:, groups].astype(np.float32)  # (N, K)
    return ((q.T.astype(np.float32) - z) * scales[:, groups]).astype(np.float32)


def _numpy(value) -> np.ndarray:
    return value.numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


# --- the checkpoint ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Shipped:
    """The shipped integers of one quantized Linear (``prefix``) of ``checkpoint``."""

    checkpoint: QuantizedCheckpoint
    prefix: str

    @property
    def group_size(self) -> int:
        fmt, k = self.checkpoint.format, self.checkpoint.in_features(self.prefix)
        return k if fmt.group_size == -1 else fmt.group_size

    def unpacked(self) -> tuple:
        return self.checkpoint.unpacked(self.prefix)

    def reorders(self) -> bool:
        """Whether its rows are grouped out of order (``desc_act``): ``MatMulNBits`` has no
        row permutation, so its shipped integers cannot be kept."""
        return self.unpacked()[3] is not None


class QuantizedCheckpoint(Checkpoint):
    """A :class:`Checkpoint` that names ``<prefix>.weight`` (fp32, (N, K)) for each quantized
    Linear and dequantizes it when read."""

    def __init__(self, directory: Path, fmt: Format) -> None:
        super().__init__(directory)
        self.format = fmt
        self.quantized: dict[str, Entry] = {}  # "<prefix>.weight" → its virtual entry
        for name in [n for n in self.entries if n.endswith(".qweight")]:
            prefix = name.removesuffix(".qweight")
            for part in ("qzeros", "scales"):
                self.entry(f"{prefix}.{part}")  # refused by name when missing
            scales = self.entries[f"{prefix}.scales"]
            n = scales.shape[1]
            k = self.in_features(prefix)
            virtual = Entry(f"{prefix}.weight", scales.file, torch.float32, (n, k), 0, n * k * 4)
            self.quantized[virtual.name] = virtual
            self.entries[virtual.name] = virtual
        logger.info(
            "%s in %s: %d Linear weights read from their shipped integers (dequantized to fp32 "
            "for the eager model; --weights int4 keeps the integers, other formats start from "
            "the dequantized weights)",
            fmt.label, directory, len(self.quantized),
        )  # fmt: skip

    def describe(self) -> dict:
        """What the report says of the checkpoint: its format and the parameters that come
        with shipped integers."""
        return {**self.format.describe(), "parameters": sorted(self.quantized)}

    def in_features(self, prefix: str) -> int:
        qweight = self.entry(f"{prefix}.qweight")
        return qweight.shape[0] if self.format.method == "awq" else qweight.shape[0] * 8

    def unpacked(self, prefix: str) -> tuple:
        """:func:`unpack` of ``prefix``'s shipped tensors, read one at a time."""
        parts = [
            self.tensor(f"{prefix}.{p}") if f"{prefix}.{p}" in self.entries else None
            for p in _PARTS
        ]
        return unpack(self.format, *parts)

    def dtypes(self) -> dict[str, int]:
        real = {n: e for n, e in self.entries.items() if n not in self.quantized}
        out: dict[str, int] = {}
        for e in real.values():
            if e.dtype.is_floating_point:
                key = str(e.dtype).removeprefix("torch.")
                out[key] = out.get(key, 0) + e.length
        return out

    @property
    def nbytes(self) -> int:
        return sum(e.length for n, e in self.entries.items() if n not in self.quantized)

    def tensor(self, name: str, dtype=None, *, mapped: bool = False) -> torch.Tensor:
        if name not in self.quantized:
            return super().tensor(name, dtype, mapped=mapped)
        self.reads += 1
        weight = torch.from_numpy(dequantize(*self.unpacked(name.removesuffix(".weight"))))
        return weight if dtype in (None, torch.float32) else weight.to(dtype)

    def rows(self, name: str, index, dtype: torch.dtype) -> torch.Tensor:
        if name not in self.quantized:
            return super().rows(name, index, dtype)
        return self.tensor(name, dtype)[index].clone()

    def lazy(self, name: str, dtype: torch.dtype, value_name: str | None = None):
        lazy = super().lazy(name, dtype, value_name)
        if name in self.quantized:
            lazy.meta[SHIPPED] = Shipped(self, name.removesuffix(".weight"))
        return lazy


def shipped_blocks(tensor, block_size: int):
    """For a (K, N) MatMul weight made of shipped-quantized Linears (the lazy transpose of one,
    or columns of several concatenated, possibly cast): ``rows(chunk)``, which returns the
    shipped ``(q (n, K) uint8, scales (n, groups), zero points (n, groups) uint8)`` of the next
    output rows of the weight (the weights stage packs them for its kernel), ``chunk`` being
    those rows' values (n, K) as the weights stage reads them, in order; each chunk is checked
    to be exactly what the shipped integers dequantize to (else the error says so: a weight is
    never silently replaced). ``None`` for any other weight, or one whose shipped integers
    cannot be kept at ``block_size`` (another group size; rows that ``desc_act`` reorders:
    logged, quantized again from the dequantized weight)."""
    parts = _shipped_parts(tensor)
    if not parts:
        return None
    if any(p.group_size != block_size for p in parts):
        logger.warning("%s: group size %d is not the export's block size %d: quantized again "
                       "from the dequantized weight", parts[0].prefix, parts[0].group_size,
                       block_size)  # fmt: skip
        return None
    if any(p.reorders() for p in parts):
        logger.warning(
            "%s: desc_act reorders its rows (g_idx), which MatMulNBits cannot: quantized again "
            "from the dequantized weight (block %d)", parts[0].prefix, block_size,
        )  # fmt: skip
        return None
    return _ShippedRows(parts, block_size)


def shipped_label(tensor) -> str:
    """The format a weight's shipped integers come from ("awq checkpoint")."""
    return _shipped_parts(tensor)[0].checkpoint.format.label


def export_block_size(info: dict | None, weights: str | None, asked: int) -> int:
    """The block size of an export of a checkpoint whose ``info`` (``source.info``'s
    ``quantized_checkpoint``) says how it ships: int4 keeps the shipped integers, so its group
    size overrides ``asked`` (``--block-size``; logged, and the report says so); ``asked``
    otherwise, and where the group size is no ``MatMulNBits`` block size (per column: -1)."""
    if not info or weights not in ("int4", "mixed"):
        return asked
    group = info["group_size"]
    if group < 16 or group & (group - 1):
        return asked
    if group != asked:
        logger.info("--block-size %d overridden by the %s's group size %d (its integers are "
                    "kept as shipped)", asked, info["format"], group)  # fmt: skip
    return group


class _ShippedRows:
    """The shipped integers of a weight's output rows, handed out chunk after chunk."""

    def __init__(self, parts: list[Shipped], block_size: int) -> None:
        self.parts, self.block_size = parts, block_size
        self.widths = [p.checkpoint.entry(f"{p.prefix}.scales").shape[1] for p in parts]
        self.position = 0

    def __call__(self, chunk: np.ndarray) -> tuple:
        start, stop = self.position, self.position + chunk.shape[0]
        self.position = stop % sum(self.widths)  # the next pass starts over
        made, offset = [], 0
        for part, width in zip(self.parts, self.widths, strict=True):
            lo, hi = max(start - offset, 0), min(stop - offset, width)
            if lo < hi:
                q, scales, zeros, _ = part.unpacked()
                q, scales, zeros = q[:, lo:hi], scales[lo:hi], zeros[lo:hi]
                expected = dequantize(q, scales, zeros).astype(chunk.dtype)
                if not np.array_equal(expected, chunk[offset + lo - start : offset + hi - start]):
                    raise TfgraphError(
                        f"the weight of {part.prefix} (rows {lo}:{hi}) is not what its shipped "
                        "integers dequantize to: the weights stage read it out of order; "
                        "report this with the checkpoint's config.json"
                    )
                made.append((q.T, scales, zeros))
            offset += width
        q, scales, zeros = (np.concatenate(pieces) for pieces in zip(*made, strict=True))
        return q, scales.astype(chunk.dtype), zeros  # the scales in the graph's type


def _shipped_parts(tensor) -> list[Shipped] | None:
    """The shipped Linears a (K, N) weight is made of, left to right; ``None`` if any part is
    not one."""
    from tfgraph.passes.lazy_weights import DERIVED

    made = tensor.meta.get(DERIVED)
    if made is None:
        return None
    op, arg, sources = made
    if op == "transpose" and tuple(arg) == (1, 0):
        shipped = sources[0].meta.get(SHIPPED)
        return None if shipped is None else [shipped]
    if op == "cast":
        return _shipped_parts(sources[0])
    if op == "concat" and arg in (1, -1):
        parts = [_shipped_parts(s) for s in sources]
        return None if any(p is None for p in parts) else [x for p in parts for x in p]
    return None


def load_whole(cls, config, extra: dict, checkpoint: QuantizedCheckpoint):
    """The model built from ``config`` (its ``quantization_config`` removed) with every
    tensor of ``checkpoint`` loaded, the quantized weights dequantized: where the checkpoint
    cannot stream (transformers' ``from_pretrained`` would need autoawq / gptqmodel)."""
    from tfgraph.sources.streamed import checkpoint_keys, empty_model, load_buffers

    model = empty_model(cls, config, extra)
    keys = checkpoint_keys(model, checkpoint)
    load_buffers(model, checkpoint)
    state = {name: checkpoint.tensor(key, torch.float32) for name, key in keys.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return model.eval()


def without_quantization(config) -> None:
    """Drop ``quantization_config`` from a transformers config: the model is built with plain
    Linears, which the dequantized weights fill."""
    if hasattr(config, "quantization_config"):
        del config.quantization_config
