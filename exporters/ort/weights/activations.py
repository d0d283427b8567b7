"""The activation side of accuracy-level-4 ``MatMulNBits`` in eager PyTorch: the eager
reference of a quantized artifact quantizes the activations entering each quantized weight to
int8 per block, as the kernel does (:class:`ActivationQuantizer`), and can switch that off
to measure the quantization's own effect (the parity rule of
:mod:`tfgraph.verify.activation_rule`)."""

from __future__ import annotations

import contextlib


class ActivationQuantizer:
    """The activation side of an accuracy-level-4 ``MatMulNBits`` in eager PyTorch: while the
    module runs, the left operand of every ``linear`` / ``matmul`` / ``addmm`` whose weight is
    one of the quantized parameters (matched by storage, so ``w.T`` and views count) is
    replaced by its int8 fake-quantization per block along K: ``round(x / s) · s`` with
    ``s = max|x| / 127`` over each block (a partial last block as if zero-padded)."""

    def __init__(self, blocks: dict[int, int]):
        self.blocks = blocks
        self.enabled = True  # off: the reference without activation quantization

    def install(self, module) -> None:
        """Run ``module``'s forward calls under the quantizing mode."""
        mode = self.mode()

        def enter(_module, _args):
            mode.__enter__()  # a pre-hook returning a value would replace the arguments

        def leave(_module, _args, _output):
            mode.__exit__(None, None, None)

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave, always_call=True)

    def mode(self):
        import torch
        import torch.nn.functional as F
        from torch.overrides import TorchFunctionMode

        blocks, quantizer = self.blocks, self
        # function → (index of the activation, index of the weight) in its positional args
        operands = {
            F.linear: (0, 1),
            torch.matmul: (0, 1),
            torch.Tensor.matmul: (0, 1),
            torch.Tensor.__matmul__: (0, 1),
            torch.mm: (0, 1),
            torch.bmm: (0, 1),
            torch.addmm: (1, 2),
        }

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                where = operands.get(func)
                if quantizer.enabled and where is not None and len(args) > where[1]:
                    weight = args[where[1]]
                    block = blocks.get(weight.untyped_storage().data_ptr())
                    if block is not None:
                        args = list(args)
                        args[where[0]] = fake_quantize(args[where[0]], block)
                return func(*args, **kwargs)

        return Mode()


def quantizes_activations(source) -> bool:
    """Whether ``source`` is the eager reference of kernels that quantize activations."""
    return hasattr(source.module, "_tfgraph_activation_quantizer")


@contextlib.contextmanager
def activation_quantization_off(source):
    """Within: ``source``'s eager module computes without its activation quantization."""
    quantizer = getattr(source.module, "_tfgraph_activation_quantizer", None)
    if quantizer is None:
        yield
        return
    quantizer.enabled = False
    try:
        yield
    finally:
        quantizer.enabled = True


def without_activation_quantization(source, inputs: dict) -> dict | None:
    """``source``'s eager outputs with its activation quantization off; None without one."""
    if not quantizes_activations(source):
        return None
    with activation_quantization_off(source):
        return source.eager(inputs)


def fake_quantize(x, block: int):
    """``x`` quantized to int8 per block of ``block`` along its last axis and back."""
    import torch

    k = x.shape[-1]
    pad = -k % block
    padded = torch.nn.functional.pad(x, (0, pad)) if pad else x
    blocked = padded.reshape(*padded.shape[:-1], -1, block)
    scale = blocked.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale != 0, 1 / torch.where(scale != 0, scale, 1), 0)
    q = torch.round(blocked * inverse).clamp(-127, 127) * scale
    return q.reshape(padded.shape)[..., :k].to(x.dtype)
