"""The quality bench's peers on the same checkpoint (:mod:`tfgraph.bench.quality`): llama.cpp's
GGUF (f16, Q4_0, Q4_K_M) and the onnxruntime-genai builder's int4 (``rtn``, ``k_quant``) —
how each is built, its logits over a window of token ids, and its decode step.

llama.cpp is no Python dependency of tfgraph: it is found at ``--llama-cpp DIR`` (or
``$TFGRAPH_LLAMA_CPP``), a directory holding the unpacked ``llama-cpp-python`` sdist
(``llama_cpp_python-*/``: its Python binding and ``vendor/llama.cpp``'s converter) and a cmake
build of that llama.cpp in ``build/`` (``build/bin/libllama.so``, ``llama-quantize``;
../shared/KERNELS.md says how it builds here). Without it the llama.cpp rows are skipped.

Two run-time patches make llama.cpp's ``convert_hf_to_gguf.py`` take the reference model
without editing llama.cpp's files (:func:`_convert_main`, run in a child process): its tokenizer
is a custom byte-level BPE (GPT-2's ``ByteLevel`` pre-tokenizer, regex on), whose pre-tokenizer
hash llama.cpp does not list, so ``get_vocab_base_pre`` answers ``gpt-2`` (the same
pre-tokenizer) instead of raising; and the vocabulary is read as GPT-2 BPE (Llama 3's path)
rather than trying sentencepiece first. The converter also needs a top-level ``rope_theta``
(transformers 5 writes ``rope_parameters``): a copy of the directory gets it. Token ids are
fed directly, so the GGUF vocabulary only has to keep our ids (it does: it is our
``tokenizer.json``'s, in order).

Timing (:func:`decode_step_ms`, in a child process that never imports torch, 2 threads): a
128-token prompt, then greedy steps; the median of the steps at pasts 128 … 128 + STEPS - 1.
tfgraph through its generation loop (:func:`tfgraph.runtime.stream`), the builder through
onnxruntime-genai's ``og.Generator``, llama.cpp through its binding's ``eval``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

THREADS = 2
PROMPT, STEPS = 128, 16  # the decode step is timed at pasts 128 … 143
LLAMA_ENV = "TFGRAPH_LLAMA_CPP"
GGUF_TYPES = ("Q4_0", "Q4_K_M")


def llama_cpp_dir(given: str | Path | None) -> Path | None:
    """The llama.cpp directory (module docstring), or None when there is none built."""
    root = given or os.environ.get(LLAMA_ENV)
    if not root:
        return None
    root = Path(root)
    if not (root / "build" / "bin" / "libllama.so").is_file() or not _sdists(root):
        return None
    return root


def _sdists(root: Path) -> list[Path]:
    return sorted(root.glob("llama_cpp_python-*/vendor/llama.cpp"))


def _binding(root: Path):
    """llama-cpp-python's binding on the library built in ``root``."""
    os.environ["LLAMA_CPP_LIB_PATH"] = str(root / "build" / "bin")
    sdist = str(_sdists(root)[-1].parents[1])
    if sdist not in sys.path:
        sys.path.insert(0, sdist)
    try:
        import diskcache  # noqa: F401 - llama_cache imports it; its disk cache is not used
    except ModuleNotFoundError:
        import types

        sys.modules["diskcache"] = types.ModuleType("diskcache")
    import llama_cpp

    return llama_cpp


# ------------------------------------------------------------------ building
def build_gguf(root: Path, model_dir: Path, work: Path) -> dict[str, Path]:
    """f16 and f32 GGUF of ``model_dir`` by llama.cpp's converter, Q4_0 and Q4_K_M of the f32
    one by ``llama-quantize``; → {"f32": path, "f16": …, "Q4_0": …, "Q4_K_M": …}."""
    work.mkdir(parents=True, exist_ok=True)
    copy = work / "hf"
    if not copy.is_dir():
        shutil.copytree(model_dir, copy)
        config = json.loads((copy / "config.json").read_text())
        theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        config.setdefault("rope_theta", theta)
        (copy / "config.json").write_text(json.dumps(config, indent=2))
    files = {}
    for outtype in ("f32", "f16"):
        out = files[outtype] = work / f"model-{outtype}.gguf"
        if not out.is_file():
            cmd = [sys.executable, "-m", "tfgraph.bench.quality_peers", "convert", str(root)]
            cmd += [str(copy), "--outtype", outtype, "--outfile", str(out)]
            _check(subprocess.run(cmd, capture_output=True, text=True), "convert_hf_to_gguf")
    for kind in GGUF_TYPES:
        out = files[kind] = work / f"model-{kind}.gguf"
        if not out.is_file():
            tool = root / "build" / "bin" / "llama-quantize"
            cmd = [str(tool), str(files["f32"]), str(out), kind, str(THREADS)]
            _check(subprocess.run(cmd, capture_output=True, text=True), "llama-quantize")
    return files


def build_genai(model_dir: Path, out: Path, algo: str, block: int) -> Path:
    """The onnxruntime-genai builder's int4 for the CPU (``algo_config``, ``block_size``),
    its sessions told to use :data:`THREADS` threads."""
    if not (out / "model.onnx").is_file():
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model_dir)]
        cmd += ["-o", str(out), "-p", "int4", "-e", "cpu", "-c", str(out.parent / "cache")]
        cmd += ["--extra_options", f"algo_config={algo}", f"block_size={block}"]
        _check(subprocess.run(cmd, capture_output=True, text=True), "onnxruntime-genai builder")
    return pin_genai_threads(out, THREADS)


def pin_genai_threads(out: Path, threads: int) -> Path:
    """The builder's export in ``out`` with its decoder session on ``threads`` intra-op
    threads (and one inter-op), written into its genai_config.json; ``out``."""
    path = out / "genai_config.json"
    config = json.loads(path.read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options.update({"intra_op_num_threads": threads, "inter_op_num_threads": 1})
    path.write_text(json.dumps(config, indent=2))
    return out


def _check(done: subprocess.CompletedProcess, what: str) -> None:
    if done.returncode:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise RuntimeError(f"{what} failed: {(lines or ['no output'])[-1][:300]}")


# ------------------------------------------------------------------ logits
class GgufLogits:
    """llama.cpp's logits at every position of a window (a fresh KV cache per window)."""

    def __init__(self, root: Path, path: Path, context: int) -> None:
        llama_cpp = _binding(root)
        self.model = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=context,
            n_batch=context,
            n_ubatch=context,
            logits_all=True,
            n_threads=THREADS,
            n_threads_batch=THREADS,
            verbose=False,
        )

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        self.model.reset()
        self.model.eval([int(i) for i in ids])
        return np.array(self.model.scores[: len(ids)], np.float32)

    def close(self) -> None:
        self.model.close()


class GenaiLogits:
    """The builder's graph run by ONNX Runtime on a window with an empty past."""

    def __init__(self, directory: Path) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = THREADS, 1
        self.session = ort.InferenceSession(
            str(directory / "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        self.pasts = []
        for port in self.session.get_inputs():
            if port.name.startswith("past_key_values."):
                heads, size = port.shape[1], port.shape[3]
                if not isinstance(size, int):  # "kv_cache_dim": the head size
                    config = json.loads((directory / "genai_config.json").read_text())
                    size = config["model"]["decoder"]["head_size"]
                self.pasts.append((port.name, (1, heads, 0, size)))

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        feeds = {
            "input_ids": np.asarray(ids, np.int64)[None],
            "attention_mask": np.ones((1, len(ids)), np.int64),
        }
        feeds.update({name: np.zeros(shape, np.float32) for name, shape in self.pasts})
        return np.asarray(self.session.run(["logits"], feeds)[0][0], np.float32)

    def close(self) -> None:
        del self.session


# ------------------------------------------------------------------ decode step
def decode_step_ms(engine: str, path: Path, llama: Path | None = None) -> float:
    """One child process's median decode step in ms (module docstring): ``engine`` is
    ``tfgraph``, ``genai`` or ``gguf``."""
    cmd = [sys.executable, "-m", "tfgraph.bench.quality_peers", "time", engine, str(path)]
    if llama is not None:
        cmd += ["--llama-cpp", str(llama)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    _check(done, f"decode timing of {path.name}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["ms"])


def _prompt() -> list[int]:
    return np.random.default_rng(0).integers(10, 3000, PROMPT).tolist()


def _time_tfgraph(path: Path) -> list[float]:
    from tfgraph.runtime import CachedDecoder, GenerationConfig, open_runner, stream

    decoder = CachedDecoder(open_runner(path, threads=THREADS))
    config = GenerationConfig(max_new_tokens=STEPS + 1)
    times, last = [], None
    for _ in stream(decoder, [_prompt()], config):  # the first yield is the prefill's
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return times


def _time_genai(path: Path) -> list[float]:
    import onnxruntime_genai as og

    model = og.Model(str(path))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=PROMPT + STEPS + 1, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(_prompt())
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        generator.generate_next_token()
        times.append(time.perf_counter() - start)
    return times


def _time_gguf(path: Path, root: Path) -> list[float]:
    llm = GgufLogits(root, path, PROMPT + STEPS + 1).model
    llm.eval(_prompt())
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        llm.eval([token])
        times.append(time.perf_counter() - start)
    return times


# ------------------------------------------------------------------ child processes
def _convert_main(root: Path, argv: list[str]) -> None:
    """llama.cpp's ``convert_hf_to_gguf.py`` with the two run-time patches (module docstring)."""
    import runpy

    source = _sdists(root)[-1]
    sys.path[:0] = [str(source), str(source / "gguf-py")]
    import conversion.base as base

    original = base.TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:  # an unlisted hash: ours is GPT-2's byte-level BPE
            return "gpt-2"

    def no_sentencepiece(self, *args, **kwargs):
        raise FileNotFoundError("a byte-level BPE: no sentencepiece model")

    base.TextModel.get_vocab_base_pre = pre_tokenizer
    base.TextModel._set_vocab_sentencepiece = no_sentencepiece
    base.TextModel._set_vocab_llama_hf = no_sentencepiece
    sys.argv = [str(source / "convert_hf_to_gguf.py"), *argv]
    runpy.run_path(sys.argv[0], run_name="__main__")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="quality bench peers: child processes")
    parser.add_argument("task", choices=["convert", "time"])
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.task == "convert":
        _convert_main(Path(args.args[0]), args.args[1:])
        return
    timing = argparse.ArgumentParser()
    timing.add_argument("engine", choices=["tfgraph", "genai", "gguf"])
    timing.add_argument("path", type=Path)
    timing.add_argument("--llama-cpp", type=Path)
    options = timing.parse_args(args.args)
    if options.engine == "tfgraph":
        times = _time_tfgraph(options.path)
    elif options.engine == "genai":
        times = _time_genai(options.path)
    else:
        times = _time_gguf(options.path, options.llama_cpp)
    print(json.dumps({"ms": 1000 * statistics.median(times), "steps": len(times)}))


if __name__ == "__main__":
    main()
