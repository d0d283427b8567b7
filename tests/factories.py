"""Factories for `export pkg.module:function` tests (this directory is on sys.path in tests)."""

import torch
from torch import nn


class TinyLM(nn.Module):
    """A model with no tfgraph input protocol: inputs are inferred from its embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        h = h + torch.tanh(self.mix(h)).cumsum(dim=1) / tokens.shape[1]
        return self.head(h)


def tiny_lm():
    torch.manual_seed(0)
    return TinyLM()


def tiny_lm_with_inputs():
    torch.manual_seed(0)
    return TinyLM(), (torch.randint(0, 50, (2, 6)),)


def zoo_gpt():
    from tfgraph.models import build

    return build("gpt-tiny", seed=3)


def not_a_module():
    return 42


def tiny_hf_llama():
    """A transformers ``PreTrainedModel`` from a factory (the Hugging Face source takes it)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()
