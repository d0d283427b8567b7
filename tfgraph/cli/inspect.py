"""``tfgraph inspect PATH``: op histogram, fusions, signature and (``--target``) static
compatibility of an artifact. Loads no torch."""

from __future__ import annotations

import json
from pathlib import Path

from tfgraph.cli.output import print_compatibility, print_fusions, table
from tfgraph.errors import TfgraphError, first_line


def add_parser(sub):
    p = sub.add_parser("inspect", help="op histogram, fusions and signature of an artifact")
    p.add_argument("path", help="artifact directory or .onnx file")
    p.add_argument(
        "--target",
        help="also check the graph statically against a target's backend (tensorrt[@X.Y]: "
        "TensorRT's ONNX parser); exit 1 when a node is known to be refused",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    import onnx_ir as ir

    from tfgraph.contract import signature_of
    from tfgraph.exporters.compile import count_fusions
    from tfgraph.passes.pipeline.fusions import op_histogram
    from tfgraph.runtime.session import checked_model

    path, _ = checked_model(args.path)  # format and external-data locations checked first
    try:
        model = ir.load(path)
    except Exception as exc:
        first = first_line(exc)
        raise TfgraphError(f"cannot read '{path}' as ONNX ({first}); re-export it") from exc
    fusions = _report_fusions(path.parent / "report.json") or count_fusions(model, "unknown")
    print(f"{path}  opsets {dict(sorted(model.opset_imports.items()))}")
    signature = signature_of(model)
    for title, ports in (("inputs", signature.inputs), ("outputs", signature.outputs)):
        rows = [
            [p.name, p.role + (f" {p.layer}" if p.layer is not None else ""), p.dtype, str(p.shape)]
            for p in ports
        ]
        print(table(rows, [title[:-1], "role", "dtype", "shape"]))
        print()
    hist = op_histogram(model)
    print(table([[op, str(n)] for op, n in hist.most_common()], ["op", "count"]))
    print(f"{sum(hist.values())} nodes\n")
    print_fusions(fusions, verbose=True)
    for kind, v in fusions.items():  # per layer: what each PyTorch module became
        for layer in v.get("fused_layers", []):
            print(f"  fused {kind} in {layer['module'] or '<top level>'}: {layer['op']}")
    if args.target is not None:
        from tfgraph.exporters.targets import get_target

        target = get_target(args.target)
        findings = target.compatibility(model)
        print()
        if not findings:
            print(f"{target.label} compatibility: nothing known to stop its parser")
        print_compatibility(findings, {"label": target.label}, verbose=True)
        if any(f["severity"] == "error" for f in findings):
            return 1
    return 0


def _report_fusions(report_file: Path) -> dict | None:
    """The fusions of an artifact's report.json; None when missing or unreadable (recount)."""
    try:
        return json.loads(report_file.read_text())["fusions"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
