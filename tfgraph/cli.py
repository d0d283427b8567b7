"""``python -m tfgraph``: export, run, generate, bench, inspect, models.

``main(argv) -> int``; the CLI prints, the library logs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from .errors import TfgraphError, first_line

EXPORT_STEPS = ("load", "trace", "passes", "save", "parity")


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _progress(total: int):
    start = time.perf_counter()
    seen: list[str] = []

    def report(step: str) -> None:
        seen.append(step)
        print(
            f"[{len(seen)}/{total}] {step} … ({time.perf_counter() - start:.1f} s)",
            file=sys.stderr,
            flush=True,
        )

    return report


def _cmd_export(args) -> int:
    from .exporting import export
    from .parity import Tolerance

    result = export(
        args.model,
        args.output,
        pipeline=args.pipeline,
        profile=args.profile,
        opset=args.opset,
        check_each_pass=args.check_each_pass,
        external_data=True if args.external_data else None,
        trust_remote_code=args.trust_remote_code,
        attn_implementation=args.attn_implementation,
        dump_after=args.dump_after,
        kv_cache=args.kv_cache,
        tolerance=Tolerance(args.atol, args.rtol),
        precision=args.precision,
        keep_io_types=args.keep_io_types,
        weights=args.weights,
        block_size=args.block_size,
        accuracy_level=args.accuracy_level,
        symmetric=args.symmetric,
        quantize_lm_head=not args.no_quantize_lm_head,
        progress=_progress(
            len(EXPORT_STEPS) + (args.precision != "fp32") + 2 * (args.weights is not None)
        ),
    )
    report = result.report
    if args.verbose:
        rows = [
            [p["name"], f"{p['seconds'] * 1000:.1f} ms", str(p["modified"])]
            for p in report["passes"]
        ]
        print(_table(rows, ["pass", "time", "modified"]))
        print()
    files = [*result.manifest["files"], "manifest.json", "report.json"]
    print(f"wrote {result.out_dir}/ ({', '.join(files)})")
    _print_fusions(report["fusions"], verbose=args.verbose)
    _print_precision(report.get("precision") or {}, verbose=args.verbose)
    _print_weights(report.get("weights"), verbose=args.verbose)
    _print_compatibility(report.get("compatibility") or [], report["target"], args.verbose)
    _print_parity(report["parity"], cached=bool(report.get("kv_cache")))
    if not result.passed:
        print(f"error: parity failed; see {result.out_dir / 'report.json'}", file=sys.stderr)
        return 1
    return 0


def _print_parity(parity: dict, *, cached: bool) -> None:
    rows = [
        [
            o["name"],
            f"{o['max_abs_err']:.3g}",
            f"{o['max_rel_err']:.3g}",
            _tolerance_text(o),
            "pass" if o["passed"] else "FAIL",
        ]
        for o in parity["outputs"]
    ]
    shapes = ", ".join(f"{b}x{s}" for b, s in parity["shapes"])
    print(f"parity vs eager PyTorch (batch x seq: {shapes}):")
    print(_table(rows, ["output", "max abs err", "max rel err", "tolerance", "result"]))
    if cached:
        rows = [
            [
                phase,
                str(parity[phase]["cases"]),
                f"{parity[phase]['max_abs_err']:.3g}",
                "pass" if parity[phase]["passed"] else "FAIL",
            ]
            for phase in ("prefill", "decode")
        ]
        print(f"KV cache: prefill (empty past) and {parity['decode_steps']} decode steps:")
        print(_table(rows, ["phase", "cases", "max abs err", "result"]))
        greedy = parity.get("greedy")
        if greedy:
            low = next(k for k in greedy if k.startswith("equal_to_") and "fp32" not in k)
            print(
                f"greedy {greedy['steps']} tokens x 2 prompts: {greedy['equal_to_fp32_eager']}/"
                f"{greedy['tokens']} equal to fp32 eager, {greedy[low]}/{greedy['tokens']} to "
                f"{low.split('_')[2]} eager (reported, not judged: near ties)"
            )


def _tolerance_text(row: dict) -> str:
    tol = row["tolerance"]
    if "atol" in tol:
        return f"atol {tol['atol']:g} rtol {tol['rtol']:g}"
    if "activation_quant_err" in row:
        return f"{tol['factor']:g} x act. quant err {row['activation_quant_err']:.3g} + fp32 tol"
    eager = row.get("eager_low_err", float("nan"))
    if eager == float("inf"):
        return f"eager {tol['precision']} overflows: within 1e-2 of scale"
    return f"{tol['factor']:g} x eager {tol['precision']} err {eager:.3g} + {tol['floor_ulps']} ulp"


def _print_precision(precision: dict, *, verbose: bool) -> None:
    """The fp32 islands of a low-precision export, and where the model leaves fp16."""
    if precision.get("precision", "fp32") == "fp32":
        return
    islands = precision["islands"]
    print(
        f"precision {precision['precision']}: {len(islands)} node(s) kept in fp32"
        + (" (inputs/outputs fp32)" if precision.get("keep_io_types") else "")
    )
    overflow = precision.get("first_overflow")
    if overflow:
        what = (
            "overflows fp16 (max 65504)"
            if overflow["max_abs"] > 65504
            else (f"leaves fp16's headroom (|x| > {precision['overflow_limit']:.5g})")
        )
        print(
            f"  {what} first at {overflow['module'] or '<top level>'}: {overflow['value']} "
            f"reaches {overflow['max_abs']:.4g}; kept in fp32 there"
        )
    shown = islands if verbose else islands[:5]
    for island in shown:
        print(f"  fp32 {island['op']} in {island['module'] or '<top level>'}: {island['reason']}")
    if len(islands) > len(shown):
        print(f"  … {len(islands) - len(shown)} more (-v lists all)")
    for stray in precision.get("unresolved", []):
        where = stray["module"] or "<top level>"
        print(f"  still off in {where}: {stray['value']} strays {stray['error']:.3g}")


def _print_weights(weights: dict | None, *, verbose: bool) -> None:
    """What ``--weights`` quantized, the bytes, and how far it moved the fp32 model."""
    if not weights:
        return
    kind = "symmetric" if weights["symmetric"] else "asymmetric"
    before, after = (weights[k] / (1 << 20) for k in ("weight_bytes_before", "weight_bytes_after"))
    print(
        f"weights {weights['weights']} (block {weights['block_size']}, {kind}, accuracy level "
        f"{weights.get('accuracy_level', 0)}): "
        f"{len(weights['quantized'])} MatMul weights in MatMulNBits, "
        f"{before:.2f} -> {after:.2f} MiB"
    )
    shown = weights["unquantized"] if verbose else weights["unquantized"][:3]
    for row in shown:
        print(f"  kept {row.get('module') or row.get('node')}: {row['reason']}")
    error = weights.get("error_vs_fp32") or {}
    if error:
        line = f"  vs the fp32 model: max logits err {error['max_logits_err']:.3g}"
        if "greedy_tokens" in error:
            line += f", greedy tokens {error['greedy_agreement']}/{error['greedy_tokens']} equal"
        print(line)


def _print_fusions(fusions: dict, *, verbose: bool) -> None:
    rows = [[k, f"{v['fused']}/{v['total']}", str(len(v["missed"]))] for k, v in fusions.items()]
    print(_table(rows, ["fusion", "fused/total", "missed"]))
    if not any(v["total"] or v["missed"] for v in fusions.values()):
        print("  no attention, norm or GELU candidates found: nothing to fuse (not a transformer?)")
    for kind, v in fusions.items():
        shown = v["missed"] if verbose else v["missed"][:3]
        for miss in shown:
            label = "excluded" if miss.get("excluded") else "missed"
            print(f"  {label} {kind} in {miss['module'] or '<top level>'}: {miss['reason']}")
        if len(v["missed"]) > len(shown):
            print(f"  … {len(v['missed']) - len(shown)} more {kind} misses (-v lists all)")


def _cmd_triton(args) -> int:
    from tfgraph.serving import write_repository

    models = write_repository(
        args.path,
        args.output,
        name=args.name,
        max_batch_size=args.max_batch_size,
        max_sequence=args.max_sequence,
        concurrency=args.concurrency,
    )
    print(f"wrote Triton model repository {args.output}/")
    rows = [[m.name, m.backend, m.kind, "; ".join(m.notes)] for m in models]
    print(_table(rows, ["model", "backend", "kind", "notes"]))
    serve = next((m.name for m in models if m.kind == "generate"), None)
    if serve:
        print(f"serve: tritonserver --model-repository {args.output} (stream from '{serve}')")
    return 0


def _cmd_engine(args) -> int:
    from tfgraph.exporters.tensorrt import ProfileOptions, build_engine

    def triple(text: str, what: str) -> tuple[int, int, int]:
        try:
            lo, opt, hi = (int(v) for v in text.split(","))
        except ValueError:
            raise TfgraphError(
                f"--{what} takes MIN,OPT,MAX (three integers), got '{text}'"
            ) from None
        return lo, opt, hi

    options = ProfileOptions(
        batch=triple(args.batch, "batch"),
        sequence=triple(args.sequence, "sequence"),
        capacity=args.capacity,
    )
    engine = build_engine(args.path, options, workspace_gib=args.workspace_gib)
    print(f"wrote {engine}")
    return 0


def _cmd_parity(args) -> int:
    from .recheck import RESULT_FILE, recheck

    result = recheck(args.path, trust_remote_code=args.trust_remote_code)
    parity = result["parity"]
    print(
        f"re-checked {result['model']} ({result['precision']}) on {parity['runner']['runner']}, "
        f"eager on {result['eager_device']}"
    )
    _print_parity(parity, cached="decode" in parity)
    if parity["passed"]:
        return 0
    found = (result.get("bisect") or {}).get("first_divergence")
    if found:
        kernels = ", ".join(f"{k['op']} {k['node']}" for k in found["kernels"]) or "no fused kernel"
        print(
            f"first diverging module: {found['module']} (max abs err {found['max_abs_err']:.3g}, "
            f"max rel err {found['max_rel_err']:.3g}); inside: {kernels}"
        )
    else:
        print("bisection: every module's output within tolerance (the divergence is after them)")
    print(f"error: parity failed; see {Path(args.path) / RESULT_FILE}", file=sys.stderr)
    return 1


def _cmd_inspect(args) -> int:
    import onnx_ir as ir

    from tfgraph.runtime.session import checked_model

    from .contract import signature_of
    from .fusions import count_fusions, op_histogram

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
        print(_table(rows, [title[:-1], "role", "dtype", "shape"]))
        print()
    hist = op_histogram(model)
    print(_table([[op, str(n)] for op, n in hist.most_common()], ["op", "count"]))
    print(f"{sum(hist.values())} nodes\n")
    _print_fusions(fusions, verbose=True)
    for kind, v in fusions.items():  # per layer: what each PyTorch module became
        for layer in v.get("fused_layers", []):
            print(f"  fused {kind} in {layer['module'] or '<top level>'}: {layer['op']}")
    if args.target is not None:
        from tfgraph.targets import get_target

        target = get_target(args.target)
        findings = target.compatibility(model)
        print()
        if not findings:
            print(f"{target.label} compatibility: nothing known to stop its parser")
        _print_compatibility(findings, {"label": target.label}, verbose=True)
        if any(f["severity"] == "error" for f in findings):
            return 1
    return 0


def _print_compatibility(findings: list[dict], target: dict, verbose: bool) -> None:
    """A target's static check of the graph (TensorRT's parser): counts, then the findings."""
    if not findings:
        return
    label = target.get("label") or target.get("name")
    errors = sum(f["severity"] == "error" for f in findings)
    print(
        f"{label} compatibility: {errors} node(s) its parser refuses, "
        f"{len(findings) - errors} unverified"
    )
    shown = findings if verbose else findings[:8]
    rows = [
        [f["severity"], f["op"], f["module"] or f["node"] or "-", f["reason"], f["fix"]]
        for f in shown
    ]
    print(_table(rows, ["severity", "op", "module", "reason", "what to do"]))
    if len(findings) > len(shown):
        print(f"  … {len(findings) - len(shown)} more (-v lists all)")


def _report_fusions(report_file: Path) -> dict | None:
    """The fusions of an artifact's report.json; None when missing or unreadable (recount)."""
    try:
        return json.loads(report_file.read_text())["fusions"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _parse_ids(text: str, flag: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError as exc:
        raise TfgraphError(f"{flag} must be integers separated by spaces, got '{text}'") from exc
    if not ids:
        raise TfgraphError(f"{flag} is empty; give at least one token id")
    return ids


def _cmd_run(args) -> int:
    import numpy as np

    from tfgraph import contract
    from tfgraph.runtime import open_runner

    session = open_runner(args.path, providers=args.provider)
    signature = session.signature
    feeds = _load_inputs(args.inputs, signature)
    batch = next(iter(feeds.values())).shape[0] if feeds else 1
    # encoder-decoder: --input-ids (or --inputs) feed the encoder, the decoder's tokens come
    # from --decoder-input-ids (default "0")
    seq2seq = signature.input(contract.ENCODER_TOKEN_IDS) is not None or (
        args.decoder_input_ids is not None
    )

    def ids_of(text: str | None, flag: str) -> np.ndarray | None:
        return None if text is None else np.array([_parse_ids(text, flag)] * batch, np.int64)

    ids = ids_of(args.input_ids, "--input-ids")
    tokens = ids_of(args.decoder_input_ids or "0", "--decoder-input-ids") if seq2seq else ids
    for port in signature.inputs:
        if port.role in (contract.TOKEN_IDS, contract.ENCODER_TOKEN_IDS) and port.name not in feeds:
            if (tokens if port.role == contract.TOKEN_IDS else ids) is None:
                raise TfgraphError(
                    'give the tokens: --input-ids "1 2 3" (an encoder-decoder: also '
                    "--decoder-input-ids)"
                )
    for port in signature.inputs:
        if port.name in feeds:
            continue
        if port.role == contract.TOKEN_IDS:
            feeds[port.name] = tokens
        elif port.role == contract.ENCODER_TOKEN_IDS:
            feeds[port.name] = ids
        elif port.role == contract.ATTENTION_MASK:
            feeds[port.name] = np.ones_like(tokens)
        elif port.role == contract.ENCODER_ATTENTION_MASK:
            feeds[port.name] = np.ones_like(ids)
        elif port.role == contract.PAST_LENGTH:  # a shared-buffer cached artifact
            feeds[port.name] = np.zeros(1, np.int64)
        elif port.role in (contract.PAST_KEY, contract.PAST_VALUE):  # start from no past
            feeds[port.name] = np.zeros((batch, port.shape[1], 0, port.shape[3]), np.float32)
        else:
            raise TfgraphError(
                f"the model takes input '{port.name}', which `run` cannot fill: give it with "
                "--inputs FILE.npz (arrays named by input)"
            )
    outputs = session.run(feeds)
    rows = []
    for name, value in outputs.items():
        row = [name, str(value.dtype), str(tuple(value.shape))]
        port = next((p for p in signature.outputs if p.name == name), None)
        if value.ndim == 3 and port is not None and port.role == contract.LOGITS:
            # (B, T, vocab): the next-token prediction of the last position
            last = value[0, -1]
            top = np.argsort(last)[::-1][:5]
            row.append("next token top-5: " + " ".join(f"{t}({last[t]:.2f})" for t in top))
        else:
            row.append(np.array2string(value.reshape(-1)[:6], precision=4))
        rows.append(row)
    print(_table(rows, ["output", "dtype", "shape", "values"]))
    if args.save:
        try:
            np.savez(args.save, **outputs)
        except OSError as exc:
            raise TfgraphError(f"cannot save outputs to '{args.save}': {exc.strerror}") from exc
        print(f"saved outputs to {args.save}")
    return 0


def _cmd_generate(args) -> int:
    from tfgraph.runtime import CachedDecoder, GenerationConfig, generate, open_runner

    decoder = CachedDecoder(open_runner(args.path, providers=args.provider))
    tokenizer = None
    if args.text is not None:
        from tfgraph.runtime.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.path)
        prompts = [tokenizer(t)["input_ids"] for t in args.text]
    elif args.input_ids:
        prompts = [_parse_ids(t, "--input-ids") for t in args.input_ids]
    elif args.inputs and decoder.seq2seq:  # a speech encoder-decoder: features feed the encoder
        prompts = []
    else:
        raise TfgraphError('give a prompt: --input-ids "1 2 3" (or --text with a tokenizer)')
    extra = _load_inputs(args.inputs, decoder.session.signature, decoder.encoder)
    if decoder.seq2seq and not prompts:
        batch = next(iter(extra.values())).shape[0]
        prompts = [[args.decoder_start_token_id]] * batch
    elif decoder.seq2seq:  # encoder-decoder: prompts feed the encoder
        from tfgraph.runtime.generate import seq2seq_prompts

        prompts, feeds = seq2seq_prompts(
            decoder, prompts, args.pad_token_id, args.decoder_start_token_id
        )
        extra = {**extra, **feeds}
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        do_sample=args.do_sample,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=args.eos_token_id,
        pad_token_id=args.pad_token_id,
    )
    start = time.perf_counter()

    def progress(done: int) -> None:
        if done % 16 == 0 or done == args.max_new_tokens:
            print(f"[{done}/{args.max_new_tokens}] tokens …", file=sys.stderr, flush=True)

    result = generate(decoder, prompts, config, extra=extra, progress=progress)
    seconds = time.perf_counter() - start
    for row, tokens in enumerate(result.tokens):
        text = " ".join(map(str, tokens))
        if tokenizer is not None:
            text = tokenizer.decode(tokens)
        print(f"[{row}] {text}")
    total = sum(len(t) for t in result.tokens)
    print(f"{total} tokens in {seconds:.2f} s ({total / seconds:.1f} tokens/s)", file=sys.stderr)
    return 0


def _cmd_coverage(args) -> int:
    from tfgraph import coverage

    only = [m for m in (args.only or "").split(",") if m] or None
    if args.list:
        rows = [[m, k, c] for m, k, c in coverage.architectures(only)]
        print(_table(rows, ["model type", "kind", "class"]))
        print(f"{len(rows)} architectures")
        return 0

    def progress(row: dict, done: int, total: int) -> None:
        attention = row.get("attention")
        print(
            f"[{done}/{total}] {row['model_type']:<24} {row['kind']:<15} {row['status']:<13} "
            f"attention {attention[0] if attention else '-'}/{attention[1] if attention else '-'}"
            f"  parity {row.get('parity', '-')}  tokens {row.get('tokens_equal', '-')}"
            f"  ({row.get('seconds', 0):.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    data = coverage.run(
        Path(args.out),
        only=only,
        jobs=args.jobs,
        limit=args.limit,
        fresh=args.fresh,
        progress=progress,
    )
    s = data["summary"]
    print(
        f"{s['architectures']} architectures: {s['traced']} traced, {s['complete']} complete; "
        f"wrote {Path(args.out) / 'COVERAGE.md'} and coverage.json"
    )
    return 0


def _load_inputs(path: str | None, *signatures) -> dict:
    """``--inputs FILE.npz``: arrays named by the inputs of the artifact's graphs (speech
    features, pixel values …), checked against their dtypes and ranks."""
    import numpy as np

    if path is None:
        return {}
    try:
        with np.load(path) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as exc:
        raise TfgraphError(f"cannot read --inputs '{path}': {first_line(exc)}") from exc
    ports = {}
    for signature in signatures:
        if signature is None:
            continue
        signature = getattr(signature, "signature", signature)  # a runner, or its signature
        ports.update({p.name: p for p in signature.inputs})
    for name, value in arrays.items():
        port = ports.get(name)
        if port is None:
            raise TfgraphError(
                f"--inputs '{path}' has '{name}', which is not an input of the model (inputs: "
                f"{', '.join(ports)})"
            )
        if port.shape is not None and value.ndim != len(port.shape):
            raise TfgraphError(
                f"--inputs '{name}' has rank {value.ndim}; the model takes {list(port.shape)}"
            )
        want = np.float32 if (port.dtype or "float").startswith("float") else np.int64
        if np.dtype(value.dtype).kind != np.dtype(want).kind:
            raise TfgraphError(f"--inputs '{name}' is {value.dtype}; the model takes {port.dtype}")
        arrays[name] = value.astype(want)
    if not arrays:
        raise TfgraphError(f"--inputs '{path}' holds no arrays")
    return arrays


def _cmd_bench(args) -> int:
    try:
        from tfgraph.bench.suite import SECTIONS, run_suite
    except ImportError as exc:
        raise TfgraphError(
            f"bench needs its extras ({exc.name} is missing): pip install 'tfgraph[bench]'"
        ) from exc
    unknown = [s for s in args.only or [] if s not in SECTIONS]
    if unknown:
        raise TfgraphError(f"unknown section {unknown}: choose from {', '.join(SECTIONS)}")
    start = time.perf_counter()

    def progress(step: str) -> None:
        print(f"[bench {time.perf_counter() - start:6.1f} s] {step}", file=sys.stderr, flush=True)

    suite = run_suite(args.quick, args.out, only=args.only, progress=progress)
    rows = [
        [name, f"{info['seconds']:.0f} s", info.get("error") or info.get("skipped") or "ok"]
        for name, info in suite["sections"].items()
    ]
    print(_table(rows, ["section", "time", "status"]))
    plots = len(suite["plots"])
    print(f"wrote {args.out / 'BENCHMARKS.md'} and {args.out / 'bench'}/ (JSON, {plots} plots)")
    failed = [n for n, info in suite["sections"].items() if "error" in info]
    if failed:
        print(f"error: sections failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _cmd_fuzz(args) -> int:
    try:
        from .fuzz import FuzzCase, check_case, run_fuzz
    except ImportError as exc:
        raise TfgraphError(
            f"fuzz needs its test extras ({exc.name} is missing): pip install 'tfgraph[dev]'"
        ) from exc
    from tfgraph.targets import get_target, target_names

    profiles = tuple(p.strip() for p in args.profiles.split(",") if p.strip())
    unknown = []
    for name in profiles:
        try:
            get_target(name)
        except TfgraphError:
            unknown.append(name)
    if unknown or not profiles:
        raise TfgraphError(f"--profiles {args.profiles!r}: choose from {', '.join(target_names())}")
    if args.replay is not None:
        return _fuzz_replay(args.replay, profiles, not args.no_cache, FuzzCase, check_case)
    if args.examples < 1:
        raise TfgraphError(f"--examples must be at least 1, got {args.examples}")
    report = run_fuzz(
        args.examples,
        args.seed,
        profiles=profiles,
        cache=not args.no_cache,
        keep_going=args.keep_going,
        progress=_fuzz_progress,
    )
    _print_fuzz_summary(report)
    if report.passed:
        return 0
    for failure in report.failures:
        print(f"\n{failure}")
        for note in getattr(failure, "__notes__", []):
            print(note)
    print(
        f"error: {len(report.failures)} failure(s); rerun with --seed {report.seed} "
        f"--examples {report.requested}, or replay a case with --replay (above)",
        file=sys.stderr,
    )
    return 1


def _fuzz_replay(text: str, profiles, cache: bool, case_cls, check) -> int:
    """``fuzz --replay JSON``: check one case, as a failure message prints it."""
    try:
        case = case_cls.from_dict(json.loads(text))
    except (ValueError, TypeError, KeyError) as exc:
        raise TfgraphError(f"--replay needs a case as JSON, as a failure prints: {exc}") from exc
    print(f"replay: {case.summary()}", file=sys.stderr, flush=True)
    try:
        timings = check(case, profiles=profiles, cache=cache)
    except AssertionError as exc:
        print(exc)
        return 1
    print(_table([[k, f"{v:.2f} s"] for k, v in timings.items()], ["stage", "time"]))
    print("passed")
    return 0


def _fuzz_progress(event) -> None:
    if event.outcome is None:
        print(f"[{event.label}] {event.case.summary()}", file=sys.stderr, flush=True)
        return
    where = f" in {event.stage}" if event.stage else ""
    print(
        f"[{event.label}] {event.outcome}{where} ({event.seconds:.1f} s)",
        file=sys.stderr,
        flush=True,
    )


def _print_fuzz_summary(report) -> None:
    examples = len(report.example_seconds)
    per = sum(report.example_seconds) / max(examples, 1)
    row = [
        f"{examples}/{report.requested}",
        str(report.count("parity")),
        str(report.count("fusion")),
        str(report.count("crash")),
        str(report.shrink_runs),
        f"{report.seconds:.0f} s ({per:.1f} s/example)",
    ]
    header = ["examples", "parity failures", "incomplete fusions", "crashes", "shrink runs"]
    print(_table([row], [*header, "time"]))
    if report.near_duplicates:
        print(f"{report.near_duplicates} near-duplicate cases skipped (Hypothesis mutations)")
    print(f"seed {report.seed}: {'passed' if report.passed else 'FAILED'}")


def models_table(markdown: bool = False) -> str:
    """The preset list: one row per preset with its family and features."""
    from tfgraph.models import PRESETS, describe

    header = ["preset", "family", "attention", "positions", "norm", "ffn"]
    rows = [[name, *(describe(name)[k] for k in header[1:])] for name in PRESETS]
    if not markdown:
        return _table(rows, header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [
        "| " + " | ".join(f"`{r[0]}`" if i == 0 else r[i] for i in range(len(r))) + " |"
        for r in rows
    ]
    return "\n".join(lines)


def _cmd_models(args) -> int:
    print(models_table(markdown=args.markdown))
    return 0


def _cmd_targets(args) -> int:
    from tfgraph.targets import targets

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
    print(_table(rows, columns))
    print("\nparameterized: tensorrt@X.Y (TensorRT version; plain 'tensorrt' is 10.15)")
    if args.verbose:
        for target in targets().values():
            print(f"\n{target.label}:")
            for fact in target.facts:
                print(f"  - {fact}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from tfgraph.passes import PIPELINES
    from tfgraph.targets import target_names

    from . import __version__

    parser = argparse.ArgumentParser(
        prog="tfgraph", description="Compile PyTorch transformers to proven ONNX artifacts."
    )
    parser.add_argument("--version", action="version", version=f"tfgraph {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def verbose(p):
        p.add_argument("-v", "--verbose", action="store_true", help="per-pass and per-layer detail")

    p = sub.add_parser("export", help="trace, optimize, export to ONNX and check parity")
    p.add_argument("model", help="preset name, package.module:function, or a HF model directory")
    p.add_argument("-o", "--output", required=True, type=Path, help="artifact directory")
    p.add_argument("--pipeline", default="default", choices=list(PIPELINES))
    p.add_argument(
        "--profile",
        "--target",
        dest="profile",
        default="ort",
        metavar="TARGET",
        help=f"target backend: {', '.join(target_names())}, or tensorrt@X.Y "
        "(python -m tfgraph targets lists them; default: ort)",
    )
    p.add_argument(
        "--opset", type=int, help="default-domain opset (default: the target's; 20 for ort)"
    )
    p.add_argument(
        "--check-each-pass",
        action="store_true",
        help="run the ONNX checker and shape inference after every pass",
    )
    p.add_argument(
        "--external-data",
        action="store_true",
        help="store weights in model.onnx.data (automatic past 2 GB)",
    )
    p.add_argument(
        "--dump-after",
        metavar="PASS",
        help="also save the graph after pass PASS as after_PASS.onnx in the artifact",
    )
    p.add_argument("--atol", type=float, default=1e-4, help="parity: absolute tolerance")
    p.add_argument("--rtol", type=float, default=1e-3, help="parity: relative tolerance")
    p.add_argument(
        "--precision",
        choices=["fp32", "fp16", "bf16"],
        default="fp32",
        help="the graph's float type; fp32 islands are kept where measured values need them "
        "(targets list what they take: `tfgraph targets`)",
    )
    p.add_argument(
        "--weights",
        choices=["int8", "int4"],
        help="weight-only quantization of MatMul weights (MatMulNBits, ort targets); parity "
        "then runs against eager with the same dequantized weights",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=32,
        help="--weights: rows of K per scale (a power of two >= 16; default 32)",
    )
    p.add_argument(
        "--accuracy-level",
        type=int,
        choices=[0, 4],
        help="--weights: MatMulNBits accuracy level. 4 (default on the CPU): activations "
        "quantized to int8 per block, the fast kernel, and the eager reference quantizes them "
        "alike; 0: fp32 activations",
    )
    p.add_argument(
        "--symmetric", action="store_true", help="--weights: no zero points (default asymmetric)"
    )
    p.add_argument(
        "--no-quantize-lm-head",
        action="store_true",
        help="--weights: keep the LM head in fp32 (embeddings always stay fp32)",
    )
    p.add_argument(
        "--keep-io-types",
        action="store_true",
        help="with --precision fp16/bf16: fp32 inputs and outputs (cast at the graph's edge)",
    )
    p.add_argument(
        "--attn-implementation",
        choices=["eager", "sdpa"],
        help="Hugging Face directories: attention implementation to load (default: the "
        "library's; falls back to eager if the default does not trace)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a model directory's own Python code to run",
    )
    p.add_argument(
        "--kv-cache",
        action="store_true",
        help="decoders: add past/present KV inputs and outputs (for `generate`); parity then "
        "checks prefill and decode steps",
    )
    verbose(p)
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("run", help="run an artifact on token ids with ONNX Runtime")
    p.add_argument("path", help="artifact directory or .onnx file")
    p.add_argument("--input-ids", help='token ids, e.g. "1 2 3"')
    p.add_argument("--decoder-input-ids", help="decoder token ids (encoder-decoder models)")
    p.add_argument(
        "--inputs",
        metavar="FILE.npz",
        help="inputs that are not token ids (input_features, pixel_values …), named by input",
    )
    p.add_argument(
        "--provider",
        action="append",
        default=None,
        help="cpu (default), cuda or tensorrt; repeat for a fallback order",
    )
    p.add_argument("--save", metavar="FILE.npz", help="save all outputs")
    verbose(p)
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser(
        "coverage",
        help="export every architecture of the installed transformers, tiny, and measure it "
        "(long: run outside CI)",
    )
    p.add_argument("--out", default="docs", help="directory for COVERAGE.md and coverage.json")
    p.add_argument("--only", help="comma-separated model types (e.g. gpt2,llama)")
    p.add_argument("--jobs", type=int, default=1, help="architectures measured at once")
    p.add_argument("--limit", type=int, default=None, help="at most this many new rows")
    p.add_argument("--fresh", action="store_true", help="redo rows already in coverage.json")
    p.add_argument("--list", action="store_true", help="list the architectures and stop")
    verbose(p)
    p.set_defaults(func=_cmd_coverage)

    p = sub.add_parser("generate", help="generate tokens with a KV-cached artifact")
    p.add_argument("path", help="artifact directory exported with --kv-cache")
    p.add_argument(
        "--input-ids",
        action="append",
        help='prompt token ids, e.g. "1 2 3"; repeat for a batch (left-padded)',
    )
    p.add_argument("--text", action="append", help="prompt text (the artifact's tokenizer)")
    p.add_argument(
        "--inputs",
        metavar="FILE.npz",
        help="encoder inputs that are not token ids (a speech model's input_features), by name",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--do-sample", action="store_true", help="sample instead of greedy")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--eos-token-id", type=int, default=None)
    p.add_argument("--pad-token-id", type=int, default=0)
    p.add_argument(
        "--decoder-start-token-id",
        type=int,
        default=0,
        help="encoder-decoder models: the first decoder token",
    )
    p.add_argument("--provider", action="append", default=None, help="cpu (default) or cuda")
    verbose(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("bench", help="benchmarks: prefill, decode, compile cost, peers")
    p.add_argument("--quick", action="store_true", help="tiny models, few sizes (minutes)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="results directory")
    p.add_argument("--only", action="append", help="run only this section (repeatable)")
    verbose(p)
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "parity",
        help="re-check an artifact against its source here; on failure name the first "
        "diverging module",
    )
    p.add_argument("path", help="artifact directory (tfgraph export's)")
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a model directory's own Python code to run",
    )
    verbose(p)
    p.set_defaults(func=_cmd_parity)

    p = sub.add_parser(
        "engine", help="build TensorRT engines for an artifact exported with --target tensorrt"
    )
    p.add_argument("path", help="artifact directory (exported with --target tensorrt[@X.Y])")
    p.add_argument("--batch", default="1,1,8", help="MIN,OPT,MAX batch (default 1,1,8)")
    p.add_argument(
        "--sequence", default="1,128,1024", help="MIN,OPT,MAX new tokens (default 1,128,1024)"
    )
    p.add_argument("--capacity", type=int, default=2048, help="KV positions (default 2048)")
    p.add_argument("--workspace-gib", type=float, default=4.0, help="builder workspace (GiB)")
    verbose(p)
    p.set_defaults(func=_cmd_engine)

    p = sub.add_parser(
        "triton", help="write a Triton Inference Server model repository from an artifact"
    )
    p.add_argument("path", help="artifact directory (tfgraph export's)")
    p.add_argument("-o", "--output", required=True, help="repository directory to write")
    p.add_argument("--name", help="the engine model's name (default: the artifact directory's)")
    p.add_argument(
        "--max-batch-size",
        type=int,
        default=8,
        help="max_batch_size of a batchable (uncached) engine; 0 turns batching off",
    )
    p.add_argument(
        "--max-sequence",
        type=int,
        help="capacity of a shared KV buffer held as Triton state (default: the model's "
        "max positions, else 2048)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="the most generation requests decoded in one batch",
    )
    verbose(p)
    p.set_defaults(func=_cmd_triton)

    p = sub.add_parser("inspect", help="op histogram, fusions and signature of an artifact")
    p.add_argument("path", help="artifact directory or .onnx file")
    p.add_argument(
        "--target",
        help="also check the graph statically against a target's backend (tensorrt[@X.Y]: "
        "TensorRT's ONNX parser); exit 1 when a node is known to be refused",
    )
    verbose(p)
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("fuzz", help="differential fuzzing: random zoo models through every profile")
    p.add_argument("--examples", type=int, default=20, help="examples to draw (default 20)")
    p.add_argument("--seed", type=int, default=0, help="campaign seed (same seed, same cases)")
    p.add_argument(
        "--profiles",
        default="ort,onnx,tensorrt",
        help="comma-separated profiles to export each example for (default: all)",
    )
    p.add_argument(
        "--no-cache",
        action="store_true",
        help="skip the KV-cached export and greedy generation checks",
    )
    p.add_argument(
        "--keep-going",
        action="store_true",
        help="run every example and list all failures (no shrinking); default: stop at the "
        "first failure and shrink it to a minimal config",
    )
    p.add_argument("--replay", metavar="JSON", help="check one case printed by a failure")
    verbose(p)
    p.set_defaults(func=_cmd_fuzz)

    p = sub.add_parser("targets", help="list the targets (backends) and what each lowers to")
    verbose(p)
    p.set_defaults(func=_cmd_targets)

    p = sub.add_parser("models", help="list the model presets")
    p.add_argument("--markdown", action="store_true", help="as a Markdown table (README)")
    verbose(p)
    p.set_defaults(func=_cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.verbose:  # third-party libraries stay quiet unless something is wrong
        for name in ("onnx_ir", "onnxscript", "torch"):
            logging.getLogger(name).setLevel(logging.WARNING)
    if getattr(args, "provider", "x") is None:
        args.provider = ["cpu"]
    try:
        return args.func(args)
    except TfgraphError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
