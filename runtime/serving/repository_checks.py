"""Offline checks of a Triton repository's configs (:mod:`.repository`): each ``config.pbtxt``
parsed against Triton's ``ModelConfig`` and, for an engine model, its names against the ONNX
graph (this machine has no onnxruntime backend to load them)."""

from __future__ import annotations

from pathlib import Path

from tfgraph.errors import TfgraphError


def parse_config(path: Path):
    """``config.pbtxt`` parsed into Triton's ``ModelConfig`` (a one-line error if it is not
    one: a misspelt field, a bad enum)."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except (ImportError, RuntimeError) as exc:  # RuntimeError: tritonclient without [grpc]
        raise TfgraphError(
            "checking Triton configs needs tritonclient with gRPC: pip install "
            "'tritonclient[grpc]' (or 'tfgraph[serve]')"
        ) from exc
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(Path(path).read_text(), config)
    except text_format.ParseError as exc:
        raise TfgraphError(f"{path}: not a valid Triton model config: {exc}") from exc
    return config


def check_config(path: Path, model_dir: Path, graph: Path | None = None) -> None:
    """Parse ``path`` against ``ModelConfig`` and, for an onnxruntime model (or a TensorRT plan
    built from ``graph``), check its names against the ONNX graph: every graph input is a
    config input or a state's input, every config output a graph output."""
    config = parse_config(path)
    if config.backend == "onnxruntime":
        onnx_file = graph or model_dir / "1" / "model.onnx"
    elif config.platform == "tensorrt_plan" and graph is not None:
        onnx_file = graph  # the graph the engine was built from
    else:
        return
    import onnx

    graph = onnx.load(str(onnx_file), load_external_data=False).graph
    graph_inputs = {i.name for i in graph.input} - {i.name for i in graph.initializer}
    graph_outputs = {o.name for o in graph.output}
    state_in = {s.input_name for s in config.sequence_batching.state}
    state_out = {s.output_name for s in config.sequence_batching.state}
    given = {i.name for i in config.input} | state_in
    produced = {o.name for o in config.output} | state_out
    problems = []
    if given != graph_inputs:
        problems.append(f"inputs {sorted(given ^ graph_inputs)} differ from the graph's")
    if not produced <= graph_outputs:
        problems.append(f"outputs {sorted(produced - graph_outputs)} are not the graph's")
    if problems:
        raise TfgraphError(f"{path}: " + "; ".join(problems))
