"""What more than one command prints: tables, step progress, and the export report's sections
(parity, precision, weights, fusions, target compatibility)."""

from __future__ import annotations

import sys
import time

from tfgraph.progress import Listener, eta


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=False)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


class StageLines(Listener):
    """``[i/n] stage …`` as each stage starts, ``[i/n] stage: 12.3 s`` as it ends, and within
    a long stage a line every few seconds: count done, time so far, time left at that pace."""

    EVERY_S = 5.0

    def __init__(self, total: int) -> None:
        self.total = total
        self.start = time.perf_counter()
        self.seen: list[str] = []
        self.last_tick = 0.0

    def __call__(self, step: str) -> None:  # the plain callback form of ``export(progress=)``
        self.started(step)

    def started(self, name: str) -> None:
        self.seen.append(name)
        self.last_tick = time.perf_counter()
        _err(f"[{len(self.seen)}/{self.total}] {name} … ({self._at():.1f} s)")

    def finished(self, name: str, seconds: float) -> None:
        index = self.seen.index(name) + 1 if name in self.seen else len(self.seen)
        _err(f"[{index}/{self.total}] {name}: {seconds:.1f} s")

    def ticked(self, what: str, done: int, total: int, seconds: float) -> None:
        now = time.perf_counter()
        if seconds < self.EVERY_S:
            return  # a short loop (or its start): its stage line says enough
        if now - self.last_tick < self.EVERY_S and done < total:
            return
        self.last_tick = now
        left = eta(done, total, seconds)
        tail = f", ~{left:.0f} s left" if left else ""
        _err(f"      {what}: {done}/{total} ({seconds:.0f} s{tail})")

    def _at(self) -> float:
        return time.perf_counter() - self.start


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def progress(total: int) -> StageLines:
    return StageLines(total)


def print_parity(parity: dict, *, cached: bool) -> None:
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
    print(table(rows, ["output", "max abs err", "max rel err", "tolerance", "result"]))
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
        print(table(rows, ["phase", "cases", "max abs err", "result"]))
        rows = parity.get("rows")
        if rows and "skipped" not in rows:
            print(
                f"rows at their own lengths: {rows['requests']} requests through 2 slots "
                f"against each alone, max abs err {rows['max_abs_err']:.3g}"
                + (
                    f" (within 2 x the decode rule's {rows['decode_allowed']:.3g})"
                    if "decode_allowed" in rows
                    else ""
                )
                + (": pass" if rows["passed"] else ": FAIL")
            )
        rule = parity.get("kv_rule")
        if rule:  # an int8 cache
            effect = rule["quantization_effect"]
            print(
                f"int8 KV cache: error within 2 x the quantization's own effect (prefill "
                f"{effect['prefill']:.3g}, decode {effect['decode']:.3g}) + fp32 tolerance: "
                f"atol {rule['bound_atol']:.3g}"
            )
        greedy = parity.get("greedy")
        if greedy and rule:
            print(
                f"greedy {greedy['steps']} tokens x 2 prompts: {greedy['equal_to_fp32_eager']}/"
                f"{greedy['tokens']} equal to fp32 eager (reported, not judged: near ties)"
            )
        elif greedy:
            low = next(k for k in greedy if k.startswith("equal_to_") and "fp32" not in k)
            print(
                f"greedy {greedy['steps']} tokens x 2 prompts: {greedy['equal_to_fp32_eager']}/"
                f"{greedy['tokens']} equal to fp32 eager, {greedy[low]}/{greedy['tokens']} to "
                f"{low.split('_')[2]} eager (reported, not judged: near ties)"
            )


def _tolerance_text(row: dict) -> str:
    tol = row["tolerance"]
    if "atol" in tol:
        scaled = " x max|eager|" if tol.get("relative_to") else ""
        return f"atol {tol['atol']:g} rtol {tol['rtol']:g}{scaled}"
    if "fp64" in tol.get("rule", ""):  # a deep model's fp32 noise (tfgraph.verify.fp32_noise)
        noise = row.get("eager_fp64_err", float("nan"))
        return f"{tol['factor']:g} x fp32 noise {noise:.3g} + fp32 tol"
    if "activation_quant_err" in row:
        return f"{tol['factor']:g} x act. quant err {row['activation_quant_err']:.3g} + fp32 tol"
    eager = row.get("eager_low_err", float("nan"))
    if eager == float("inf"):
        return f"eager {tol['precision']} overflows: within 1e-2 of scale"
    return f"{tol['factor']:g} x eager {tol['precision']} err {eager:.3g} + {tol['floor_ulps']} ulp"


def print_precision(precision: dict, *, verbose: bool) -> None:
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


def print_weights(weights: dict | None, *, verbose: bool) -> None:
    """What ``--weights`` quantized, the bytes, and how far it moved the fp32 model."""
    if not weights:
        return
    kind = "symmetric" if weights["symmetric"] else "asymmetric"
    before, after = (weights[k] / (1 << 20) for k in ("weight_bytes_before", "weight_bytes_after"))
    tables = sum(1 for row in weights["quantized"] if row.get("op") == "Gather")
    gathered = f"{tables} embedding tables in GatherBlockQuantized, " if tables else ""
    method = weights.get("method", "rtn")  # rtn (round to nearest): named only by default
    method = "" if method == "rtn" else f" by {method}"
    calibration = weights.get("calibration")
    if calibration:
        method += f" on {calibration['tokens']} calibration tokens"
    print(
        f"weights {weights['weights']}{method} (block {weights['block_size']}, {kind}, "
        f"accuracy level {weights.get('accuracy_level', 0)}): "
        f"{len(weights['quantized']) - tables} MatMul weights in MatMulNBits, {gathered}"
        f"{before:.2f} -> {after:.2f} MiB"
    )
    if weights.get("source_format"):  # an AWQ/GPTQ checkpoint's own integers, zero points kept
        note = weights.get("block_size_note")
        print(
            f"  {weights['shipped_weights']} weights as the {weights['source_format']} ships them "
            f"(its zero points; {note or 'its group size'}); the rest as above"
        )
    mixed = weights.get("mixed")
    if mixed:
        eight = [row for row in mixed["sensitivity"] if row["bits"] == 8]
        print(f"  int8: {len(eight)} most sensitive weights ({mixed['int8_held']:.1%} of them)")
        for row in mixed["sensitivity"] if verbose else eight[:3]:
            print(f"    {row['module']}: sensitivity {row['sensitivity']:.3g}, {row['bits']} bits")
    shown = weights["unquantized"] if verbose else weights["unquantized"][:3]
    for row in shown:
        print(f"  kept {row.get('module') or row.get('node')}: {row['reason']}")
    error = weights.get("error_vs_fp32") or {}
    if error:
        line = f"  vs the fp32 model: max logits err {error['max_logits_err']:.3g}"
        if "greedy_tokens" in error:
            line += (
                f", fp32's top token on the artifact's {error['greedy_tokens']} greedy tokens: "
                f"{error['greedy_agreement']} equal"
            )
        print(line)


def print_fusions(fusions: dict, *, verbose: bool) -> None:
    rows = [[k, f"{v['fused']}/{v['total']}", str(len(v["missed"]))] for k, v in fusions.items()]
    print(table(rows, ["fusion", "fused/total", "missed"]))
    if not any(v["total"] or v["missed"] for v in fusions.values()):
        print("  no attention, norm or GELU candidates found: nothing to fuse (not a transformer?)")
    for kind, v in fusions.items():
        shown = v["missed"] if verbose else v["missed"][:3]
        for miss in shown:
            label = "excluded" if miss.get("excluded") else "missed"
            print(f"  {label} {kind} in {miss['module'] or '<top level>'}: {miss['reason']}")
        if len(v["missed"]) > len(shown):
            print(f"  … {len(v['missed']) - len(shown)} more {kind} misses (-v lists all)")


def print_compatibility(findings: list[dict], target: dict, verbose: bool) -> None:
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
    print(table(rows, ["severity", "op", "module", "reason", "what to do"]))
    if len(findings) > len(shown):
        print(f"  … {len(findings) - len(shown)} more (-v lists all)")


def quality_rows(figures: dict) -> list[str]:
    """One row of :func:`print_quality`'s table: an artifact's quality figures."""
    return [
        f"{figures['ppl']:.4f}",
        f"{figures['ppl_ref']:.4f}",
        f"{figures['delta_ppl']:+.4f} ({figures['delta_ppl_pct']:+.2f}%)",
        f"{figures['kl_mean']:.3g}",
        f"{figures['kl_max']:.3g}",
        f"{100 * figures['top1']:.2f}%",
        str(figures["tokens"]),
    ]


QUALITY_HEADER = ["PPL", "fp32 PPL", "ΔPPL", "mean KL", "max KL", "top-1", "tokens"]


def print_quality(figures: dict | None, *, line: bool = False) -> None:
    """The quality figures (``tfgraph quality``, ``export --quality-text``): a table, or with
    ``line`` one line of the export's summary."""
    if not figures:
        return
    if line:
        ppl, ref, delta, kl, _, top1, _ = quality_rows(figures)
        print(f"quality over {figures['text']}: PPL {ppl} (fp32 {ref}, Δ {delta}), "
              f"mean KL {kl}, top-1 {top1}")  # fmt: skip
        return
    print(
        f"quality of {figures['artifact']} over {figures['text']}: {figures['windows']} windows "
        f"of {figures['window']} tokens against {figures['reference']} ({figures['seconds']:.1f} s)"
    )
    print(table([quality_rows(figures)], QUALITY_HEADER))
