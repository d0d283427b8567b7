"""The encoder-decoder side of the ``optimum`` flavour: Optimum's ``ORTModelForSeq2SeqLM`` and
transformers.js's ``text2text-generation`` file pair, built from tfgraph's own pair.

tfgraph's cached seq2seq export splits at the cross-attention K/V: ``onnx/encoder.onnx``
returns each decoder layer's cross keys and values, ``onnx/model.onnx`` takes them. The clients
split one step earlier, at the encoder's last hidden state:

- ``onnx/encoder_model.onnx``: ``input_ids`` -> ``last_hidden_state`` (tfgraph's encoder cut
  before the cross projections);
- ``onnx/decoder_model_merged.onnx``: ``input_ids``, ``encoder_hidden_states`` (and
  ``encoder_attention_mask`` where the model was traced with one),
  ``past_key_values.{i}.decoder.key`` / ``.value`` (the growing
  self-attention cache) and ``past_key_values.{i}.encoder.key`` / ``.value`` -> ``logits``,
  ``present.{i}.decoder.*``, ``present.{i}.encoder.*``: tfgraph's decoder with the cross
  projections moved in front of it (:func:`onnx.compose.merge_graphs`).

The merged decoder computes the cross K/V from ``encoder_hidden_states`` at the first step
(the clients feed an empty encoder past then) and returns them as ``present.{i}.encoder.*``;
later steps return the ``past_key_values.{i}.encoder.*`` the clients feed back (an If on the
past's length, in place of Optimum's ``use_cache_branch`` input, which transformers.js feeds
only where a graph takes it).

Where tfgraph traced the model without a padding mask (its Hugging Face seq2seq wrapper: an
all-ones mask), the encoder takes no ``attention_mask`` and the decoder's slot mask is ones
inside the graph: a padded batch sees its pads, in the clients exactly as in tfgraph's runtime
(batch 1 is Hugging Face's own result).

tfgraph's own files stay beside these (its runtime reads ``onnx/model.onnx`` and
``onnx/encoder.onnx``): the weights are stored twice.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx.compose
import onnx.utils

from tfgraph import contract
from tfgraph.errors import TfgraphError

ENCODER_MODEL = "onnx/encoder_model.onnx"
DECODER_MERGED = "onnx/decoder_model_merged.onnx"
EXTERNAL_FROM = 64 * 1024**2  # as tfgraph's own files (exporters/onnx_file.py)
_PREFIX = "optimum_cross_"


def _roles(model: onnx.ModelProto) -> dict:
    return contract.read_roles({p.key: p.value for p in model.metadata_props})


def _hidden_state(encoder: onnx.ModelProto, outputs: list[str], hidden: int) -> str:
    """The last value every cross K/V output is computed from with the model's hidden width
    (batch, sequence, hidden): the encoder's last hidden state."""
    graph = encoder.graph
    reach = {name: {i} for i, name in enumerate(outputs)}
    for node in reversed(graph.node):
        found = set().union(*(reach.get(o, set()) for o in node.output))
        for name in node.input:
            reach.setdefault(name, set()).update(found)
    inferred = onnx.shape_inference.infer_shapes(encoder)
    shapes = {
        v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
        for v in [*inferred.graph.value_info, *inferred.graph.input]
    }
    everything = set(range(len(outputs)))
    found = None
    for node in graph.node:
        for name in node.output:
            shape = shapes.get(name) or []
            if reach.get(name) == everything and len(shape) == 3 and shape[-1] == hidden:
                found = name
    if found is None:
        raise TfgraphError(
            "--flavour optimum: the encoder's last hidden state was not found before the "
            "cross-attention projections; export it with --flavour tfgraph"
        )
    return found


def _rename(graph: onnx.GraphProto, names: dict[str, str]) -> None:
    """Rename values everywhere in ``graph`` (inputs, outputs, node ends, initializers)."""
    for value in [*graph.input, *graph.output, *graph.value_info, *graph.initializer]:
        value.name = names.get(value.name, value.name)
    for node in graph.node:
        node.input[:] = [names.get(n, n) for n in node.input]
        node.output[:] = [names.get(n, n) for n in node.output]


def _reorder(field, order: list[str]) -> None:
    by_name = {v.name: v for v in field}
    ranked = [by_name[n] for n in order if n in by_name]
    ranked += [v for v in field if v.name not in order]
    copies = [type(v)() for v in ranked]
    for copy, value in zip(copies, ranked, strict=True):
        copy.CopyFrom(value)
    del field[:]
    field.extend(copies)


def _cache_names(layers: int, side: str, kinds=("decoder", "encoder")) -> list[str]:
    return [f"{side}.{i}.{k}.{kv}" for i in range(layers) for k in kinds for kv in ("key", "value")]


def _save(model: onnx.ModelProto, stage: Path, name: str, external: bool | None) -> list[str]:
    path = stage / name
    size = sum(len(t.raw_data) for t in model.graph.initializer)
    if external or (external is None and size > EXTERNAL_FROM):
        data = f"{path.name}_data"  # transformers.js's name for one chunk
        onnx.save_model(model, path, save_as_external_data=True, location=data, size_threshold=256)
        return [name, f"{Path(name).parent.as_posix()}/{data}"]
    onnx.save_model(model, path)
    return [name]


def _encoder_model(encoder: onnx.ModelProto, hidden_state: str) -> onnx.ModelProto:
    inputs = [v.name for v in encoder.graph.input]
    model = onnx.utils.Extractor(encoder).extract_model(inputs, [hidden_state])
    _rename(model.graph, {hidden_state: "last_hidden_state"})
    del model.metadata_props[:]
    return model


def _projection(encoder: onnx.ModelProto, hidden_state: str, cross: list[str]):
    """The cross projections alone: ``hidden_state`` in, the cross K/V out. What they read of
    the encoder's token ids is their shape (batch, sequence): read off the hidden state."""
    ids = [v.name for v in encoder.graph.input]
    projection = onnx.utils.Extractor(encoder).extract_model([hidden_state, *ids], cross)
    for node in projection.graph.node:
        if not set(node.input) & set(ids):
            continue
        if node.op_type != "Shape":
            raise TfgraphError(
                f"--flavour optimum: the cross-attention projections read the encoder's "
                f"inputs ({node.op_type}); export it with --flavour tfgraph"
            )
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        end = min(attrs.get("end", 2), 2)  # (batch, sequence) of (batch, sequence, hidden)
        node.input[0] = hidden_state
        del node.attribute[:]
        node.attribute.extend([onnx.helper.make_attribute("start", attrs.get("start", 0)),
                               onnx.helper.make_attribute("end", end)])  # fmt: skip
    kept = [v for v in projection.graph.input if v.name not in ids]
    del projection.graph.input[:]
    projection.graph.input.extend(kept)
    return projection


def _encoder_past(name: str, roles: dict) -> str:
    role, layer = roles[name]
    return f"past_key_values.{layer}.encoder.{'key' if role == contract.CROSS_KEY else 'value'}"


def _cached(projection: onnx.ModelProto, cross: list[str], roles: dict, shape: list):
    """``projection`` run only at the clients' first step (an empty encoder past: Optimum
    and transformers.js feed 0 positions); later steps return the encoder pasts they feed
    back (an If on the first past's length): the cross K/V computed once per prompt."""
    graph = projection.graph
    outputs = [o.name for o in graph.output]
    pasts = {_PREFIX + n: _encoder_past(n, roles) for n in cross}
    dtype = graph.output[0].type.tensor_type.elem_type
    _rename(graph, {o: f"{o}__computed" for o in outputs})
    project = onnx.helper.make_graph(
        list(graph.node), "project", [], list(graph.output), list(graph.initializer)
    )
    reuse = onnx.helper.make_graph(
        [onnx.helper.make_node("Identity", [pasts[o]], [f"{o}__reused"]) for o in outputs],
        "reuse",
        [],
        [onnx.helper.make_tensor_value_info(f"{o}__reused", dtype, shape) for o in outputs],
    )
    length, empty = f"{_PREFIX}past_length", f"{_PREFIX}first_step"
    nodes = [
        onnx.helper.make_node("Shape", [pasts[outputs[0]]], [length], start=2, end=3),
        onnx.helper.make_node("Equal", [length, f"{_PREFIX}zero"], [empty]),
        onnx.helper.make_node("If", [empty], outputs, then_branch=project, else_branch=reuse),
    ]
    zero = onnx.helper.make_tensor(f"{_PREFIX}zero", onnx.TensorProto.INT64, [1], [0])
    inputs = [graph.input[0]] + [
        onnx.helper.make_tensor_value_info(pasts[o], dtype, shape) for o in outputs
    ]
    outs = [onnx.helper.make_tensor_value_info(o, dtype, shape) for o in outputs]
    wrapped = onnx.helper.make_graph(nodes, "cross", inputs, outs, [zero])
    return onnx.helper.make_model(
        wrapped, opset_imports=list(projection.opset_import), ir_version=projection.ir_version
    )


def _decoder_merged(encoder, decoder, hidden_state: str, cross: list[str], shape: list):
    roles = _roles(decoder)
    projection = _projection(encoder, hidden_state, cross)
    projection = onnx.compose.add_prefix(projection, _PREFIX)
    _rename(projection.graph, {_PREFIX + hidden_state: "encoder_hidden_states"})
    projection = _cached(projection, cross, roles, shape)
    outputs = [v.name for v in decoder.graph.output] + [_PREFIX + n for n in cross]
    # merge_graphs, not merge_models: its ONNX checker refuses ONNX Runtime's default-domain
    # kernels (SimplifiedLayerNormalization); the saved pair is checked by loading it
    graph = onnx.compose.merge_graphs(
        projection.graph, decoder.graph, io_map=[(_PREFIX + n, n) for n in cross], outputs=outputs
    )
    merged = onnx.helper.make_model(
        graph, opset_imports=list(decoder.opset_import), ir_version=decoder.ir_version
    )
    names = {"encoder_hidden_states": "encoder_hidden_states"}
    for name, (role, layer) in roles.items():
        side = {contract.PAST_KEY: "past_key_values.{}.decoder.key",
                contract.PAST_VALUE: "past_key_values.{}.decoder.value",
                contract.PRESENT_KEY: "present.{}.decoder.key",
                contract.PRESENT_VALUE: "present.{}.decoder.value",
                contract.TOKEN_IDS: "input_ids",
                contract.ENCODER_ATTENTION_MASK: "encoder_attention_mask",
                contract.LOGITS: "logits"}.get(role)  # fmt: skip
        if side is not None:
            names[name] = side.format(layer)
    entries = {name: (role, layer) for name, (role, layer) in roles.items()}
    for name in cross:
        role, layer = entries[name]
        kv = "key" if role == contract.CROSS_KEY else "value"
        names[_PREFIX + name] = f"present.{layer}.encoder.{kv}"
    _rename(merged.graph, names)
    for name, (role, _) in roles.items():
        if role == contract.ENCODER_SLOT_MASK:
            _ones_for(merged.graph, name)
    return merged


def _ones_for(graph: onnx.GraphProto, name: str) -> None:
    """Input ``name`` (the encoder slot mask tfgraph adds for in-flight batching, fed ones by
    its runtime outside it) computed as ones over the encoder positions instead: the clients
    do not feed it, and their tokens stay tfgraph's (an encoder_attention_mask here would mask
    the pads in the cross-attention only, which neither tfgraph nor Hugging Face does)."""
    value = next((v for v in graph.input if v.name == name), None)
    if value is None:
        return
    dims = f"{name}__dims"
    ones = onnx.helper.make_tensor("one", value.type.tensor_type.elem_type, [1], [1])
    nodes = [
        onnx.helper.make_node("Shape", ["encoder_hidden_states"], [dims], start=0, end=2),
        onnx.helper.make_node("ConstantOfShape", [dims], [name], value=ones),
    ]
    graph.input.remove(value)
    for node in reversed(nodes):
        graph.node.insert(0, node)


def write_seq2seq_pair(
    stage: Path, encoder_file: str, decoder_file: str, hidden: int, external: bool | None
) -> list[str]:
    """Build and save Optimum's encoder and merged decoder from tfgraph's pair in ``stage``
    (``hidden``: the model's width, that of the encoder's last hidden state); their paths
    relative to ``stage``."""
    encoder = onnx.load(stage / encoder_file)
    decoder = onnx.load(stage / decoder_file)
    enc_roles = _roles(encoder)
    cross = [v.name for v in encoder.graph.output]
    if not all(enc_roles.get(n, ("",))[0] in (contract.CROSS_KEY, contract.CROSS_VALUE)
               for n in cross):  # fmt: skip
        raise TfgraphError("--flavour optimum: the encoder graph returns more than cross K/V")
    shape = [d.dim_value for d in encoder.graph.output[0].type.tensor_type.shape.dim]
    heads, head_size = shape[1], shape[3]
    hidden_state = _hidden_state(encoder, cross, hidden)
    layers = len(cross) // 2
    past_shape = ["batch_size", heads, "encoder_sequence_length_out", head_size]
    merged = _decoder_merged(encoder, decoder, hidden_state, cross, past_shape)
    singles = ["input_ids", "encoder_attention_mask", "encoder_hidden_states"]  # a mask if any
    _reorder(merged.graph.input, singles + _cache_names(layers, "past_key_values"))
    _reorder(merged.graph.output, ["logits", *_cache_names(layers, "present")])
    del merged.metadata_props[:]
    files = _save(_encoder_model(encoder, hidden_state), stage, ENCODER_MODEL, external)
    return files + _save(merged, stage, DECODER_MERGED, external)
