"""A toy target, in one file: what adding a backend takes.

Attention becomes MatMul-Softmax-MatMul and nothing else (no fused kernel, no custom domain),
norms become standard LayerNormalization or RMSNorm written out, GELU the standard op.
Registering it makes ``--target toy`` work everywhere.
"""

from tfgraph.exporters.target import fused_ops
from tfgraph.exporters.targets import Target, register
from tfgraph.passes.lower.lower_attention import Lowered
from tfgraph.passes.lower.lower_gelu import standard_gelu

FUSED_AS = "MatMul-Softmax-MatMul (toy)"


def lower_attention(case):
    return Lowered(
        case.build.decomposed(case.v, case.bias, case.spec), "decomposed", fused_as=FUSED_AS
    )


def lower_norm(case):
    if case.rms:
        return case.decomposed("the toy target has no RMSNorm kernel")
    return case.layer_normalization()


TOY = register(
    Target(
        name="toy",
        description="test target: attention as MatMul-Softmax-MatMul only",
        opset=20,
        lower_attention=lower_attention,
        lower_norm=lower_norm,
        lower_gelu=standard_gelu,
        fused_ops=fused_ops(),
    )
)
