"""``tfgraph targets`` and ``tfgraph models``: the targets (backends) and the model presets."""

from __future__ import annotations

from tfgraph.cli.output import table


def add_parser(sub):
    p = sub.add_parser("targets", help="list the targets (backends) and what each lowers to")
    p.set_defaults(func=run_targets)

    p = sub.add_parser("models", help="list the model presets")
    p.add_argument("--markdown", action="store_true", help="as a Markdown table (README)")
    p.set_defaults(func=run_models)


def models_table(markdown: bool = False) -> str:
    """The preset list: one row per preset with its family and features."""
    from tfgraph.models import PRESETS, describe

    header = ["preset", "family", "attention", "positions", "norm", "ffn"]
    rows = [[name, *(describe(name)[k] for k in header[1:])] for name in PRESETS]
    if not markdown:
        return table(rows, header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [
        "| " + " | ".join(f"`{r[0]}`" if i == 0 else r[i] for i in range(len(r))) + " |"
        for r in rows
    ]
    return "\n".join(lines)


def run_models(args) -> int:
    print(models_table(markdown=args.markdown))
    return 0


def run_targets(args) -> int:
    from tfgraph.exporters.targets import targets

    rows = []
    for target in targets().values():
        rows.append(
            [
                target.label,
                str(target.opset),
                target.runner,
                ",".join(target.session.providers),
                ",".join(
                    p if p not in target.precision_runners else f"{p} ({target.runner_for(p)})"
                    for p in target.precisions
                ),
                ",".join(target.weight_formats) or "-",
                target.description,
            ]
        )
    columns = ["target", "opset", "runner", "providers", "precisions", "weights", "lowering"]
    print(table(rows, columns))
    print("\nparameterized: tensorrt@X.Y (TensorRT version; plain 'tensorrt' is 10.15)")
    if args.verbose:
        for target in targets().values():
            print(f"\n{target.label}:")
            for fact in target.facts:
                print(f"  - {fact}")
    return 0
