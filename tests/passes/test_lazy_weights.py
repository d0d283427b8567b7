"""The byte-moving helpers of the weight path: torch's transpose gives numpy's bytes in every
dtype, and a memory-mapped checkpoint tensor equals the copied one."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from tfgraph.passes.lazy_weights import permuted
from tfgraph.sources.checkpoint import Checkpoint


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.float64])
@pytest.mark.parametrize("perm", [(1, 0, 2), (2, 1, 0), (0, 2, 1)])
def test_permuted_is_numpys_transpose(dtype, perm):
    a = (np.random.default_rng(0).standard_normal((37, 53, 3)) * 10).astype(dtype)
    got, want = permuted(a, perm), np.ascontiguousarray(np.transpose(a, perm))
    assert got.dtype == want.dtype and got.shape == want.shape and got.flags.c_contiguous
    assert got.tobytes() == want.tobytes()


def test_permuted_reads_a_read_only_array():
    a = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    a.setflags(write=False)
    assert permuted(a, (1, 0)).tobytes() == a.T.copy().tobytes()


def test_mapped_tensor_equals_the_copied_one(tmp_path):
    import transformers

    from tfgraph.tools.random_checkpoint import write_random_checkpoint

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    checkpoint = Checkpoint(write_random_checkpoint(config, tmp_path / "ckpt", dtype="bf16"))
    assert checkpoint.entries
    for key in checkpoint.entries:
        copied = checkpoint.tensor(key)
        mapped = checkpoint.tensor(key, mapped=True)
        assert mapped.dtype == torch.bfloat16 and torch.equal(mapped, copied)
        assert torch.equal(checkpoint.tensor(key, torch.float32, mapped=True), copied.float())
        mapped.view(torch.int16).fill_(7)  # the mapping is private: the file is untouched
        assert torch.equal(checkpoint.tensor(key), copied)
