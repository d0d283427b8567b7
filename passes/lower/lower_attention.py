"""``LowerAttentionPass``: every ``tfgraph.Attention`` becomes what its target chooses.

The pass is the same for every target: it reads the canonical op
(:class:`~.canonical.AttentionOp`), hands an :class:`AttentionCase` to the target's
``lower_attention`` (``tfgraph/targets/*.py`` say which kernel each case becomes, and why), and
splices in what the target built with :class:`AttentionBuilder`, whose lowerings are:

- :meth:`~AttentionBuilder.gqa`: ``com.microsoft.GroupQueryAttention`` for S == T::

       Q ─ Transpose ─ Reshape ─┐ (B, T, Hq·d)
       K ─ Transpose ─ Reshape ─┤ (B, S, Hkv·d)
       V ─ Transpose ─ Reshape ─┤                  ┌─ Reshape ─ Transpose ─► Y
       Shape(K) ─► S−1, S ──────┤ seqlens_k, total ├
       bias ─ Expand(…, T, S) ──┴► GroupQueryAttention

- :meth:`~AttentionBuilder.gqa_past`: the same with ``past_key``/``past_value`` (a cached
  layer: the kernel appends the new keys and values itself);
- :meth:`~AttentionBuilder.mha`: ``com.microsoft.MultiHeadAttention`` on (B, S, H·d), K/V heads
  repeat-interleaved, any causal/window mask folded into ``attention_bias``;
- :meth:`~AttentionBuilder.attention23`: ONNX ``Attention``-23 on the 4-D inputs;
- :meth:`~AttentionBuilder.decomposed`: standard ops, scale folded into Q (what TensorRT's own
  MHA fusion takes)::

       Q ─ Mul(scale) ─► MatMul ─► Add(mask) ─► Softmax(−1) ─► MatMul ─► Y
       K ─ expand heads ─ Transpose ─┘                              │
       V ─ expand heads ────────────────────────────────────────────┘

The causal/window mask is ``Where(masked, lowest, 0)`` over ``Range(T) × Range(S)`` (the
dtype's lowest finite value, so a fully masked row gives no NaN). Every new node keeps the
canonical node's metadata (the PyTorch module name) and records ``tfgraph.lowered_from``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from tfgraph.passes.cache.row_lengths import row_lengths_value
from tfgraph.passes.canonical import AttentionOp, is_canonical
from tfgraph.passes.recognize.attention.sink import sink_column, sink_softmax_ops
from tfgraph.passes.rewrite_utils import (
    FUSED_AS_KEY,
    LOWERED_FROM_KEY,
    import_used_domains,
    insert_tape,
    mark_missed,
    replace_value,
)
from tfgraph.passes.target_arg import require_target

logger = logging.getLogger(__name__)

MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class Lowered:
    """What a target made of one canonical node: the value replacing its output, the op's
    name for logs, and either why no fused kernel was used (``missed``: reported as a miss) or
    which standard ops the target fuses itself (``fused_as``: reported as fused)."""

    value: ir.Value
    op: str
    missed: str | None = None
    fused_as: str | None = None


@dataclass
class AttentionCase:
    """One canonical attention being lowered: its inputs, its attributes and the builder."""

    node: ir.Node
    q: ir.Value
    k: ir.Value
    v: ir.Value
    bias: ir.Value | None
    spec: AttentionOp
    opset: int
    build: AttentionBuilder
    sink: ir.Value | None = None  # (Hq,) attention sinks, :mod:`.sink_rules`

    @property
    def head_size(self):
        return _dim(self.q, 3)

    @property
    def v_head_size(self):
        """V's head size: DeepSeek's MLA has V heads narrower than Q/K's."""
        return _dim(self.v, 3)

    @property
    def self_attention(self) -> bool:
        """S == T is proved by the shapes (equal ints or the same symbolic dim)."""
        return _same_dim(self.q, self.k, 2)

    def cached_kv(self) -> tuple | None:
        """(past_k, new_k, past_v, new_v, present_k, present_v) of a ``cached`` layer whose K
        and V are still the KV-cache pass's ``Concat(past input, new, axis=2)`` graph outputs
        with the new part as long as Q; ``None`` otherwise."""
        if not self.spec.cached:
            return None
        return _cached_kv(self.q, self.k, self.v)


class LowerAttentionPass(ir.passes.InPlacePass):
    """Replace every ``tfgraph.Attention`` by its target's choice (see the module docstring).

    ``target``: a :class:`tfgraph.exporters.targets.Target` (``tfgraph.exporters.targets.get_target(name)``).
    """

    def __init__(self, target) -> None:
        super().__init__()
        self.target = require_target(target)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        count = 0
        for node in list(model.graph):
            if not is_canonical(node, AttentionOp.OP):
                continue
            lowered = self._lower(model, node, count)
            logger.debug("lowered %s to %s", node.name, lowered)
            count += 1
        if count:
            import_used_domains(model)
        return ir.passes.PassResult(model, modified=bool(count))

    def ensures(self, model: ir.Model) -> None:
        left = [n.name for n in model.graph if is_canonical(n, AttentionOp.OP)]
        if left:
            raise ir.passes.PostconditionError(f"tfgraph.Attention left unlowered: {left}")

    def _lower(self, model: ir.Model, node: ir.Node, index: int) -> str:
        graph = model.graph
        q, k, v, bias, sink = (list(node.inputs) + [None, None])[:5]
        spec = AttentionOp.read(node, head_size=_dim(q, 3))
        builder = AttentionBuilder(graph, node.name or f"attention{index}", q, k)
        opset = model.opset_imports.get("", 1)
        case = AttentionCase(node, q, k, v, bias, spec, opset, builder, sink)
        result = self.target.lower_attention(case)
        y = result.value
        y.shape, y.type = node.outputs[0].shape, node.outputs[0].type
        insert_tape(graph, node, builder.tape)
        for new in builder.tape.nodes:
            new.metadata_props[LOWERED_FROM_KEY] = AttentionOp.OP
        softmax = next((n for n in builder.tape.nodes if n.op_type == "Softmax"), None)
        if softmax is not None and result.missed is not None:
            mark_missed(softmax, result.missed)
        elif softmax is not None and result.fused_as is not None:
            softmax.metadata_props[FUSED_AS_KEY] = result.fused_as
        replace_value(node.outputs[0], y)
        graph.remove(node, safe=True)
        return result.op


def _cached_kv(q: ir.Value, k: ir.Value, v: ir.Value) -> tuple | None:
    parts = []
    for value in (k, v):
        node = value.producer()
        if node is None or node.op_type != "Concat" or node.attributes.get_int("axis") != 2:
            return None
        if len(node.inputs) != 2 or not node.inputs[0].is_graph_input():
            return None
        if not value.is_graph_output() or len(value.uses()) != 1:
            return None
        if not _same_dim(q, node.inputs[1], 2):
            return None
        parts.append((node.inputs[0], node.inputs[1], value))
    (pk, nk, ck), (pv, nv, cv) = parts
    return pk, nk, pv, nv, ck, cv


def _dim(value: ir.Value, axis: int):
    shape = value.shape
    return None if shape is None or len(shape) <= axis else shape[axis]


def _dims_equal(x, y) -> bool:
    """Whether two dims are provably equal: equal ints, or the same named symbol."""
    if x is None or y is None:
        return False
    if isinstance(x, int) or isinstance(y, int):
        return x == y
    return x.value is not None and x.value == y.value


def _same_dim(a: ir.Value, b: ir.Value, axis: int) -> bool:
    return _dims_equal(_dim(a, axis), _dim(b, axis))


def _has_full_query_axis(bias: ir.Value, q: ir.Value, k: ir.Value) -> bool:
    """Whether ``bias`` is provably 4-D (…, T, S): what ORT's fused kernels accept as is."""
    if bias.shape is None or len(bias.shape) != 4:
        return False
    return _dims_equal(bias.shape[2], _dim(q, 2)) and _dims_equal(bias.shape[3], _dim(k, 2))


class AttentionBuilder:
    """Builds the replacement of one canonical node on a tape."""

    def __init__(self, graph: ir.Graph, prefix: str, q: ir.Value, k: ir.Value) -> None:
        self.tape = ir.tape.Tape()
        self.graph = graph
        self.prefix = prefix
        self.q, self.k = q, k
        self.dtype = q.dtype or ir.DataType.FLOAT
        self._consts: dict[str, ir.Value] = {}

    # -- constants and shapes -------------------------------------------------------------
    def const(self, name: str, array: np.ndarray) -> ir.Value:
        """An initializer named after the node; one per ``name`` on this tape."""
        if name in self._consts:
            return self._consts[name]
        unique, i = f"{self.prefix}_{name}", 0
        while unique in self.graph.initializers:
            i += 1
            unique = f"{self.prefix}_{name}_{i}"
        self._consts[name] = self.tape.initializer(ir.tensor(array), name=unique)
        return self._consts[name]

    def ints(self, name: str, values) -> ir.Value:
        return self.const(name, np.asarray(values, dtype=np.int64))

    def scalar(self, name: str, value: float) -> ir.Value:
        return self.const(name, np.asarray(value, dtype=self.dtype.numpy()))

    def dim(self, x: ir.Value, axis: int) -> ir.Value:
        """Dim ``axis`` of ``x`` as a 1-D int64 tensor of one element."""
        return self.tape.op("Shape", [x], {"start": axis, "end": axis + 1})

    def dim0d(self, x: ir.Value, axis: int) -> ir.Value:
        """Dim ``axis`` of ``x`` as an int64 scalar (for ``Range``)."""
        index = self.ints(f"index{axis}", axis)
        return self.tape.op("Gather", [self.tape.op("Shape", [x]), index], {"axis": 0})

    # -- layouts ----------------------------------------------------------------------------
    def to_bsh(self, x: ir.Value, name: str) -> ir.Value:
        """(B, H, S, d) → (B, S, H·d)."""
        t = self.tape.op("Transpose", [x], {"perm": [0, 2, 1, 3]})
        return self.tape.op("Reshape", [t, self.ints(f"{name}_bsh", [0, 0, -1])])

    def from_bsh(self, y: ir.Value, heads: int) -> ir.Value:
        """(B, T, H·d) → (B, H, T, d)."""
        y = self.tape.op("Reshape", [y, self.ints("y_bthd", [0, 0, heads, -1])])
        return self.tape.op("Transpose", [y], {"perm": [0, 2, 1, 3]})

    def repeat_heads5(self, x: ir.Value, spec: AttentionOp) -> ir.Value:
        """(B, Hkv, S, d) → (B, Hkv, g, S, d): flattening (Hkv, g) gives query head h the KV
        head h // g (repeat-interleave)."""
        x = self.tape.op("Unsqueeze", [x, self.ints("axis2", [2])])
        return self.tape.op("Expand", [x, self.ints("groups", [1, 1, spec.group, 1, 1])])

    def expand_heads(self, x: ir.Value, spec: AttentionOp, name: str) -> ir.Value:
        """(B, Hkv, S, d) → (B, Hq, S, d) by repeat-interleave (identity when Hkv == Hq)."""
        if spec.group == 1:
            return x
        shape = self.tape.op(
            "Concat",
            [
                self.dim(x, 0),
                self.ints("heads", [spec.num_heads, -1]),
                self.tape.op("Shape", [x], {"start": 3}),
            ],
            {"axis": 0},
        )
        return self.tape.op("Reshape", [self.repeat_heads5(x, spec), shape])  # (B, Hq, S, d)

    def expand_heads_bsh(self, x: ir.Value, spec: AttentionOp, name: str) -> ir.Value:
        """(B, Hkv, S, d) → (B, S, Hq·d), heads repeat-interleaved, with a single Transpose."""
        if spec.group == 1:
            return self.to_bsh(x, name)
        x5 = self.repeat_heads5(x, spec)
        t = self.tape.op("Transpose", [x5], {"perm": [0, 3, 1, 2, 4]})  # (B, S, Hkv, g, d)
        return self.tape.op("Reshape", [t, self.ints(f"{name}_bsh", [0, 0, -1])])

    # -- masks ------------------------------------------------------------------------------
    def causal_window_mask(
        self, spec: AttentionOp, *, causal: bool, window: int
    ) -> ir.Value | None:
        """The additive (T, S) mask: 0 where visible, the dtype's lowest value where masked.
        A cached layer whose rows have their own past lengths (:mod:`.row_lengths`) gets a
        (B, 1, T, S) mask: row b's query i sits at P_b + i, and keys after it are masked
        (whatever the buffer holds there)."""
        if not causal and not window:
            return None
        tape = self.tape
        zero, one = self.ints("zero", 0), self.ints("one", 1)
        t, s = self.dim0d(self.q, 2), self.dim0d(self.k, 2)
        i = tape.op("Unsqueeze", [tape.op("Range", [zero, t, one]), self.ints("axis1", [1])])
        j = tape.op("Range", [zero, s, one])
        rows = row_lengths_value(self.graph) if spec.cached else None
        if rows is not None:  # (P_b + i) − j, (B, 1, T, S)
            at = tape.op("Unsqueeze", [rows, self.ints("axes123", [1, 2, 3])])
            behind = tape.op("Sub", [tape.op("Add", [at, i]), j])
        else:
            # (i + S − T) − j: how far key j lies behind query i, aligned bottom-right.  (T, S)
            behind = tape.op("Sub", [tape.op("Add", [i, tape.op("Sub", [s, t])]), j])
        masked = None
        if causal:
            masked = (
                tape.op("Less", [behind, zero]) if spec.bottom_right else tape.op("Less", [i, j])
            )
        if window:
            outside = tape.op("GreaterOrEqual", [behind, self.ints("window", window)])
            masked = outside if masked is None else tape.op("Or", [masked, outside])
        lowest = float(np.finfo(self.dtype.numpy()).min)
        return tape.op("Where", [masked, self.scalar("lowest", lowest), self.scalar("zero_f", 0)])

    def full_mask(
        self, bias: ir.Value | None, spec: AttentionOp, *, causal: bool, window: int
    ) -> ir.Value | None:
        """bias + causal/window mask as a 4-D (…, T, S) tensor, since ORT's fused kernels
        reject a mask that broadcasts over the query axis; None when there is nothing."""
        mask = self.causal_window_mask(spec, causal=causal, window=window)
        if mask is not None:
            if not (spec.cached and row_lengths_value(self.graph) is not None):  # else (B,1,T,S)
                mask = self.tape.op("Unsqueeze", [mask, self.ints("axes01", [0, 1])])  # (1,1,T,S)
            return mask if bias is None else self.tape.op("Add", [bias, mask])
        if bias is None or _has_full_query_axis(bias, self.q, self.k):
            return bias
        shape = self.tape.op(
            "Concat",
            [self.ints("ones2", [1, 1]), self.dim(self.q, 2), self.dim(self.k, 2)],
            {"axis": 0},
        )
        return self.tape.op("Expand", [bias, shape])  # (B or 1, Hq or 1, T, S)

    # -- lowerings --------------------------------------------------------------------------
    def gqa(
        self, v: ir.Value, bias: ir.Value | None, spec: AttentionOp, sink: ir.Value | None = None
    ) -> ir.Value:
        """com.microsoft.GroupQueryAttention; only for S == T (checked by the caller)."""
        tape = self.tape
        # local_window_size needs causal=1: a window without causality goes in the bias.
        window = spec.window if spec.causal else 0
        attention_bias = self.full_mask(bias, spec, causal=False, window=spec.window - window)
        s = self.dim0d(self.k, 2)
        seqlens = tape.op("Sub", [s, self.ints("one", 1)])
        seqlens = tape.op("Expand", [seqlens, self.dim(self.k, 0)])  # (B,) = S − 1
        attrs = {
            "num_heads": spec.num_heads,
            "kv_num_heads": spec.kv_num_heads,
            "scale": spec.scale,
            "causal": int(spec.causal),
        }
        if spec.softcap:
            attrs["softcap"] = spec.softcap  # measured: tanh before the mask, as canonical
        if window:
            attrs["local_window_size"] = window  # measured: same semantics as our window
        inputs = [
            self.to_bsh(self.q, "q"),
            self.to_bsh(self.k, "k"),
            self.to_bsh(v, "v"),
            None,  # past_key
            None,  # past_value
            tape.op("Cast", [seqlens], {"to": ir.DataType.INT32}),
            tape.op("Cast", [s], {"to": ir.DataType.INT32}),  # total_sequence_length
        ]
        if attention_bias is not None or sink is not None:
            inputs += [None, None, None, attention_bias]  # cos, sin, position_ids, bias
        if sink is not None:
            inputs.append(sink)  # head_sink (measured: the same denominator as canonical)
        # present_key/present_value are requested although unused: without them ORT 1.32's
        # CPU kernel leaves its flash path and materializes the (Hq, T, S) scores (measured:
        # +2118 MiB at T = S = 8192, Hq = 8, against +7 MiB with them).
        y, _, _ = tape.op_multi_out(
            "GroupQueryAttention", inputs, attrs, domain=MS_DOMAIN, num_outputs=3
        )
        return self.from_bsh(y, spec.num_heads)

    def gqa_past(
        self,
        cached: tuple,
        bias: ir.Value | None,
        spec: AttentionOp,
        sink: ir.Value | None = None,
    ) -> ir.Value:
        """GroupQueryAttention with ``past_key``/``past_value``: it appends the new keys and
        values itself (its ``present_*`` become the graph's present outputs, replacing the
        KV-cache pass's Concat) and stays on its flash path at prefill. ORT 1.32 refuses
        batch > 1 with both a past and more than one new token (measured), which
        ``tfgraph.runtime`` never does: prefill has no past, decode one token."""
        tape = self.tape
        past_k, new_k, past_v, new_v, present_k, present_v = cached
        total = tape.op("Add", [self.dim(past_k, 2), self.dim(new_k, 2)])  # (1,) P + T
        total0 = tape.op("Squeeze", [total])
        rows = row_lengths_value(self.graph)
        if rows is not None:  # each row its own past length (in-flight batching)
            seqlens = tape.op(
                "Add", [rows, tape.op("Sub", [self.dim(new_k, 2), self.ints("one", 1)])]
            )
        else:
            seqlens = tape.op(
                "Expand", [tape.op("Sub", [total0, self.ints("one", 1)]), self.dim(new_k, 0)]
            )
        attrs = {
            "num_heads": spec.num_heads,
            "kv_num_heads": spec.kv_num_heads,
            "scale": spec.scale,
            "causal": 1,
        }
        if spec.softcap:
            attrs["softcap"] = spec.softcap
        if spec.window:
            attrs["local_window_size"] = spec.window
        inputs = [
            self.to_bsh(self.q, "q"),
            self.to_bsh(new_k, "k"),
            self.to_bsh(new_v, "v"),
            past_k,
            past_v,
            tape.op("Cast", [seqlens], {"to": ir.DataType.INT32}),
            tape.op("Cast", [total0], {"to": ir.DataType.INT32}),
        ]
        if bias is not None:
            if not _has_full_query_axis(bias, self.q, present_k):
                shape = tape.op(
                    "Concat",
                    [self.ints("ones2", [1, 1]), self.dim(self.q, 2), total],
                    {"axis": 0},
                )
                bias = tape.op("Expand", [bias, shape])  # (B or 1, Hq or 1, T, P + T)
        if bias is not None or sink is not None:
            inputs += [None, None, None, bias]
        if sink is not None:
            inputs.append(sink)  # head_sink
        y, key, value = tape.op_multi_out(
            "GroupQueryAttention", inputs, attrs, domain=MS_DOMAIN, num_outputs=3
        )
        for new, old in ((key, present_k), (value, present_v)):
            new.shape, new.type = old.shape, old.type
            replace_value(old, new)
        return self.from_bsh(y, spec.num_heads)

    def mha(self, v: ir.Value, attention_bias: ir.Value | None, spec: AttentionOp) -> ir.Value:
        """com.microsoft.MultiHeadAttention with 3-D (B, S, H·d) inputs: 4-D K/V measured
        slower (no flash path). ``attention_bias`` already carries any causal/window mask."""
        inputs = [
            self.to_bsh(self.q, "q"),
            self.expand_heads_bsh(self.k, spec, "k"),
            self.expand_heads_bsh(v, spec, "v"),
        ]
        if attention_bias is not None:
            inputs += [None, None, attention_bias]  # bias, key_padding_mask, attention_bias
        attrs = {"num_heads": spec.num_heads, "scale": spec.scale}
        y = self.tape.op("MultiHeadAttention", inputs, attrs, domain=MS_DOMAIN)
        return self.from_bsh(y, spec.num_heads)

    def mha_sink(self, v: ir.Value, bias: ir.Value | None, spec: AttentionOp, sink) -> ir.Value:
        """MultiHeadAttention with the sink as one more key: K and V get a zero row (its score
        q·0 is 0) and the mask a column holding each head's sink logit, so the softmax's
        denominator takes exp(sink) and the output nothing from it: exactly a sink, for the
        head sizes GroupQueryAttention refuses (MLA's narrower V)."""
        tape = self.tape
        mask = self.full_mask(bias, spec, causal=spec.causal, window=spec.window)
        if mask is None:  # (1, 1, T, S) of zeros
            shape = tape.op(
                "Concat",
                [self.ints("ones2", [1, 1]), self.dim(self.q, 2), self.dim(self.k, 2)],
                {"axis": 0},
            )
            mask = tape.op("Expand", [self.scalar("zero_f", 0), shape])
        heads = self.ints("heads_shape", [1, spec.num_heads, 1, 1])
        mask = tape.op("Expand", [mask, heads])  # (B or 1, Hq, T, S)
        mask = tape.op("Concat", [mask, sink_column(tape, mask, sink, self.ints)], {"axis": -1})

        def with_zero_row(x: ir.Value) -> ir.Value:
            shape = tape.op(
                "Concat",
                [tape.op("Shape", [x], {"end": 2}), self.ints("one1", [1]), self.dim(x, 3)],
                {"axis": 0},
            )
            zeros = tape.op("Expand", [self.scalar("zero_f", 0), shape])
            return tape.op("Concat", [x, zeros], {"axis": 2})

        inputs = [
            self.to_bsh(self.q, "q"),
            self.expand_heads_bsh(with_zero_row(self.k), spec, "k"),
            self.expand_heads_bsh(with_zero_row(v), spec, "v"),
            None,
            None,
            mask,
        ]
        attrs = {"num_heads": spec.num_heads, "scale": spec.scale}
        y = self.tape.op("MultiHeadAttention", inputs, attrs, domain=MS_DOMAIN)
        return self.from_bsh(y, spec.num_heads)

    def attention23(self, v: ir.Value, bias: ir.Value | None, spec: AttentionOp) -> ir.Value:
        """ONNX Attention-23; its ``is_causal`` (no past) is top-left, so a bottom-right mask
        with S ≠ T, or a window, is passed as ``attn_mask``."""
        self_attention = _same_dim(self.q, self.k, 2)
        native = spec.causal and not spec.window and (not spec.bottom_right or self_attention)
        if native:
            mask = self.full_mask(bias, spec, causal=False, window=0)
        else:
            mask = self.full_mask(bias, spec, causal=spec.causal, window=spec.window)
        inputs = [self.q, self.k, v] + ([mask] if mask is not None else [])
        attrs = {"scale": spec.scale, "is_causal": int(native)}
        if spec.softcap:
            attrs["softcap"] = spec.softcap
        return self.tape.op("Attention", inputs, attrs)

    def decomposed(
        self, v: ir.Value, bias: ir.Value | None, spec: AttentionOp, sink: ir.Value | None = None
    ) -> ir.Value:
        """Standard ops in the order TensorRT's MHA fusion wants (scale on Q, one mask Add);
        a sink is a column concatenated to the scores, dropped after the softmax."""
        tape = self.tape
        q = self.q
        if spec.scale != 1.0:
            q = tape.op("Mul", [q, self.scalar("scale", spec.scale)])
        k = tape.op("Transpose", [self.expand_heads(self.k, spec, "k")], {"perm": [0, 1, 3, 2]})
        scores = tape.op("MatMul", [q, k])  # (B, Hq, T, S)
        if spec.softcap:
            inner = tape.op("Mul", [scores, self.scalar("inv_softcap", 1.0 / spec.softcap)])
            scores = tape.op(
                "Mul", [tape.op("Tanh", [inner]), self.scalar("softcap", spec.softcap)]
            )
        mask = self.causal_window_mask(spec, causal=spec.causal, window=spec.window)
        if mask is not None and bias is not None:
            mask = tape.op("Add", [bias, mask])
        elif mask is None:
            mask = bias
        if mask is not None:
            scores = tape.op("Add", [scores, mask])
        if sink is not None:
            probs = sink_softmax_ops(tape, scores, sink, self.ints)
        else:
            probs = tape.op("Softmax", [scores], {"axis": -1})
        return tape.op("MatMul", [probs, self.expand_heads(v, spec, "v")])
