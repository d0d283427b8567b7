"""A Hugging Face directory's safetensors shards, read one tensor at a time.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte range) and the raw little-endian data. :class:`Checkpoint` reads only the
headers (``model.safetensors.index.json`` names the shards of a sharded checkpoint), checks
them against the files on disk, and hands out each tensor on demand: as a torch tensor in the
dtype asked for (:meth:`Checkpoint.tensor`, one read of that tensor's bytes, no mapping kept),
or as an ``onnx_ir`` lazy tensor that reads and converts when it is written or looked at
(:meth:`Checkpoint.lazy`). Nothing here ever holds more than one tensor.

A missing shard, a truncated one, or a header that does not fit its file is one error naming
the file (and the tensor); :meth:`Checkpoint.check_shapes` names a tensor whose shape is not the
model's.
"""

from __future__ import annotations

import json
import logging
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir
import torch

from tfgraph.errors import TfgraphError, first_line

logger = logging.getLogger(__name__)

READ_CHUNK = 64 << 20  # bytes read at a time where a tensor is converted as it is read

INDEX_FILE = "model.safetensors.index.json"
CHECKPOINT_KEY = "tfgraph.checkpoint_key"

# safetensors dtype names → torch dtypes (the ones checkpoints of transformers use)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class MissingTensor(TfgraphError):
    """The model needs a tensor the checkpoint does not name (renamed or computed weights)."""


@dataclass(frozen=True)
class Entry:
    """Where one tensor's bytes are: ``file``, absolute byte ``offset``, ``length``."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    length: int


class Checkpoint:
    """The tensors of the safetensors files in ``directory``, by state-dict key."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.entries: dict[str, Entry] = {}
        for file in self._shards():
            for entry in _read_header(file):
                self.entries[entry.name] = entry
        self.reads = 0  # tensors read (tests count what a stage materializes)
        self.bytes_read = 0

    @staticmethod
    def present(directory: Path) -> bool:
        return any(Path(directory).glob("*.safetensors"))

    def _shards(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        if not index.is_file():
            return sorted(self.directory.glob("*.safetensors"))
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TfgraphError(f"cannot read '{index}': {exc}; re-save the checkpoint") from exc
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (self.directory / name).is_file():
                tensor = next(k for k, v in weight_map.items() if v == name)
                raise TfgraphError(
                    f"'{index.name}' names shard '{name}' (for {tensor} and others), which is not "
                    f"in '{self.directory}': copy the missing shard or re-save the checkpoint"
                )
        return [self.directory / n for n in files]

    @property
    def nbytes(self) -> int:
        return sum(e.length for e in self.entries.values())

    def dtypes(self) -> dict[str, int]:
        """Bytes of floating tensors per dtype name (what the checkpoint is stored in)."""
        out: dict[str, int] = {}
        for e in self.entries.values():
            if e.dtype.is_floating_point:
                key = str(e.dtype).removeprefix("torch.")
                out[key] = out.get(key, 0) + e.length
        return out

    def entry(self, name: str) -> Entry:
        found = self.entries.get(name)
        if found is None:
            raise MissingTensor(
                f"the checkpoint in '{self.directory}' has no tensor '{name}', which the model "
                "needs: the shards do not match config.json (re-save the checkpoint)"
            )
        return found

    def check_shapes(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Every name in ``shapes`` (key → the model's shape) is in the checkpoint with that
        shape."""
        for name, shape in shapes.items():
            entry = self.entry(name)
            if tuple(entry.shape) != tuple(shape):
                raise TfgraphError(
                    f"tensor '{name}' in '{entry.file.name}' has shape {list(entry.shape)}, but "
                    f"the model built from config.json needs {list(shape)}: the checkpoint and "
                    "its config do not match"
                )

    def tensor(
        self, name: str, dtype: torch.dtype | None = None, *, mapped: bool = False
    ) -> torch.Tensor:
        """One tensor, read from its file, converted to ``dtype`` (its own when None).
        ``mapped``: the file's pages mapped instead of copied (writing an artifact reads each
        weight once: the copy was a third of the time it took to write a transposed fp32
        checkpoint, measured on TinyLlama 1.1B); a tensor converted to another dtype is read
        in chunks into its converted copy either way (:meth:`_converted`)."""
        entry = self.entry(name)
        if entry.offset + entry.length > entry.file.stat().st_size:
            raise TfgraphError(
                f"'{entry.file.name}' is truncated: tensor '{name}' ends past the end of "
                "the file; copy the shard again"
            )
        self.reads += 1
        self.bytes_read += entry.length
        if not entry.length:
            return torch.empty(entry.shape, dtype=dtype or entry.dtype)
        if dtype is not None and dtype != entry.dtype:  # mapped pages would stay resident
            return self._converted(entry, dtype)
        raw = self._mapped(entry) if mapped else None
        if raw is None:
            with open(entry.file, "rb") as f:
                f.seek(entry.offset)
                data = bytearray(entry.length)
                f.readinto(data)
            raw = torch.frombuffer(data, dtype=torch.uint8)
        value = raw.view(entry.dtype).reshape(entry.shape)
        if dtype is not None and dtype != entry.dtype:
            value = value.to(dtype)
        return value

    def rows(self, name: str, index, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``index`` (a slice or an array of row numbers) of a 2-D tensor, converted to
        ``dtype``: only their pages are read (a 250k-word table's prompt rows, a head's block
        of rows)."""
        entry = self.entry(name)
        raw = self._mapped(entry)
        if raw is None:  # unaligned: the whole tensor
            return self.tensor(name, dtype)[index]
        picked = raw.view(entry.dtype).reshape(entry.shape)[index]
        return picked.to(dtype) if picked.dtype != dtype else picked.clone()

    @staticmethod
    def _converted(entry, dtype: torch.dtype) -> torch.Tensor:
        """The tensor read :data:`READ_CHUNK` bytes at a time into its converted copy: the
        peak is the result and one chunk, not the stored copy beside it (a 250k-word bf16
        table: 4.1 GB in fp32, where reading it whole first held 6.1 GB)."""
        out = torch.empty(entry.shape, dtype=dtype)
        flat = out.view(-1)
        size = entry.dtype.itemsize
        step = max(1, READ_CHUNK // size)
        with open(entry.file, "rb") as f:
            f.seek(entry.offset)
            for start in range(0, flat.numel(), step):
                count = min(step, flat.numel() - start)
                data = bytearray(count * size)
                f.readinto(data)
                flat[start : start + count] = torch.frombuffer(data, dtype=entry.dtype)
        return out

    @staticmethod
    def _mapped(entry) -> torch.Tensor | None:
        """The tensor's bytes as a copy-on-write memory map: pages are read from the page
        cache as they are touched, a write (none is expected) stays private. ``None`` if the
        offset is not aligned to the element size (safetensors writers do align it)."""
        if entry.offset % entry.dtype.itemsize:
            return None
        start = entry.offset - entry.offset % mmap.ALLOCATIONGRANULARITY
        with open(entry.file, "rb") as f:
            pages = mmap.mmap(
                f.fileno(), entry.offset + entry.length - start, access=mmap.ACCESS_COPY,
                offset=start,
            )  # fmt: skip
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.frombuffer(
                pages, dtype=torch.uint8, count=entry.length, offset=entry.offset - start
            )

    def lazy(self, name: str, dtype: torch.dtype, value_name: str | None = None) -> ir.LazyTensor:
        """``name`` as an ``onnx_ir`` tensor of ``dtype`` that reads (and converts) its bytes
        each time they are asked for, and keeps nothing."""
        entry = self.entry(name)

        def read() -> ir.Tensor:
            value = self.tensor(name, dtype, mapped=True)
            return ir.Tensor(_to_numpy(value), name=value_name or name)

        lazy = ir.LazyTensor(
            read, dtype=_ir_dtype(dtype), shape=ir.Shape(entry.shape), name=value_name or name
        )
        lazy.meta[CHECKPOINT_KEY] = name  # where it comes from (the quantized reference asks)
        return lazy


def _to_numpy(value: torch.Tensor) -> np.ndarray:
    if value.dtype == torch.bfloat16:
        import ml_dtypes

        return value.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return value.numpy()


def _ir_dtype(dtype: torch.dtype) -> ir.DataType:
    return {
        torch.float32: ir.DataType.FLOAT,
        torch.float16: ir.DataType.FLOAT16,
        torch.bfloat16: ir.DataType.BFLOAT16,
        torch.float64: ir.DataType.DOUBLE,
        torch.int64: ir.DataType.INT64,
        torch.int32: ir.DataType.INT32,
        torch.int8: ir.DataType.INT8,
        torch.uint8: ir.DataType.UINT8,
        torch.bool: ir.DataType.BOOL,
    }[dtype]


def _read_header(file: Path) -> list[Entry]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise TfgraphError(f"'{file.name}' is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8 or length > 100 * 1024**2:
            raise TfgraphError(
                f"'{file.name}' is not a safetensors file, or is truncated (its header claims "
                f"{length} bytes of a {size}-byte file)"
            )
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise TfgraphError(
                f"'{file.name}' has an unreadable safetensors header: {exc}"
            ) from exc
    base = 8 + length
    entries = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise TfgraphError(f"tensor '{name}' in '{file.name}' has dtype {meta.get('dtype')}, "
                               "which tfgraph does not read")  # fmt: skip
        start, end = meta["data_offsets"]
        if base + end > size:
            raise TfgraphError(
                f"'{file.name}' is truncated: tensor '{name}' ends at byte {base + end} of a "
                f"{size}-byte file; copy the shard again"
            )
        entries.append(Entry(name, file, dtype, tuple(meta["shape"]), base + start, end - start))
    return entries


def whole_load_info(path: Path, why: str | None) -> dict:
    """What the report says of a directory loaded whole: the dtype it is stored in, the
    reference (the model loaded in fp32, as the streamed one runs) and why it did not stream."""
    stored = Checkpoint(path).dtypes() if Checkpoint.present(path) else {}
    return {
        "checkpoint_dtype": max(stored, key=stored.get) if stored else None,
        "eager_reference": "loaded whole (from_pretrained), fp32",
        "loaded_whole": why,
    }


def loading_whole(path: Path, exc: Exception) -> str:
    """Log that ``path`` loads whole because its shards do not hold the tensors the model
    names (``exc``: a :class:`MissingTensor` or a failed stream), and return the reason for
    the report: transformers renames, fuses or computes some tensors as it loads them (MoE
    experts, ViT, sinusoidal positions)."""
    logger.warning(
        "%s cannot stream from its shards (%s; transformers renames, fuses or computes "
        "such tensors as it loads): loading it whole",
        path,
        str(exc).split(": the shards do not match")[0],
    )
    return first_line(exc)
