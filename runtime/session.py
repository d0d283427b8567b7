"""Open an artifact (a directory with ``model.onnx``, or an ``.onnx`` file) with ONNX Runtime:
:class:`Session`, the ONNX Runtime implementation of the runner protocol (:mod:`.runner`).

Before ONNX Runtime sees a file, it is checked (:mod:`.model_files`): the artifact's
``manifest.json`` (if any) must be of a format this tfgraph understands, and every external-data
location must name a file inside the model's directory (no ``..``, no absolute path, no symlink
leading out). A directory's graph is the manifest's first file (``onnx/model.onnx`` in the
``optimum`` flavour).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from tfgraph import contract
from tfgraph.errors import TfgraphError, first_line
from tfgraph.runtime.model_files import checked_model, model_path, step_file
from tfgraph.runtime.runner import RUNNERS, KVCache, RoleKey

__all__ = ["PROVIDERS", "Session", "checked_model", "model_path", "state_zeros", "step_file"]

logger = logging.getLogger(__name__)

PROVIDERS = {
    "cpu": "CPUExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "tensorrt": "TensorrtExecutionProvider",
}

_ORT_DTYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(bool)": np.bool_,
    "tensor(int8)": np.int8,  # an int8 KV cache
}


# Named dims that count token positions: checked against the manifest's ``max_positions``.
SEQUENCE_DIMS = contract.SEQUENCE_DIMS
# what a cache carries from step to step: KV and the recurrent layers' states (fixed size,
# zeros before the first step, never written in place)
_STATE_PAST = {present: past for past, present in contract.STATE_PRESENT_OF.items()}
_PAST_ROLES = (contract.PAST_KEY, contract.PAST_VALUE, contract.PAST_TOKENS, *contract.STATE_ROLES)
_PRESENT_PAST = {
    contract.PRESENT_KEY: contract.PAST_KEY,
    contract.PRESENT_VALUE: contract.PAST_VALUE,
    contract.PRESENT_TOKENS: contract.PAST_TOKENS,
    **_STATE_PAST,
}


def state_zeros(batch: int, shape, dtype) -> np.ndarray:
    """A recurrent state before the first step: zeros of its static dims for ``batch`` rows."""
    dims = list(shape)[1:]
    if not all(isinstance(d, int) for d in dims):
        raise TfgraphError(f"a recurrent state's dims must be static, got {list(shape)}")
    return np.zeros((batch, *dims), dtype)


def _batch_of(feeds: Mapping[RoleKey, object]) -> int:
    """The batch of a step: the rows of its new tokens."""
    return int(np.shape(feeds[(contract.TOKEN_IDS, None)])[0])


def _shape_text(shape: Sequence) -> str:
    dims = ["?" if d is None else str(d) for d in shape]
    return f"({', '.join(dims)}{',' if len(dims) == 1 else ''})"


# ONNX Runtime 1.32's NchwcTransformer (a Conv layout rewrite, nothing a transformer needs)
# crashes the process (SIGSEGV) at session creation on some fp16 graphs: an fp16
# torch.nn.Transformer export, after MatmulTransposeFusion made its FusedMatMuls (measured;
# disabling either transformer avoids it, ORT_ENABLE_EXTENDED too).
ALWAYS_DISABLED = ("NchwcTransformer",)


QUANTIZED_OPS = frozenset({
    "MatMulNBits", "GatherBlockQuantized", "MatMulInteger", "DynamicQuantizeMatMul",
    "QLinearMatMul", "DequantizeLinear", "MatMulIntegerToFloat",
})  # fmt: skip


def _quantized(path: Path) -> bool:
    """Whether the graph at ``path`` holds a quantized weight op (read without its data)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return any(n.op_type in QUANTIZED_OPS for n in model.graph.node)


class Session:
    """An ONNX Runtime session over a tfgraph artifact.

    ``providers`` are names from :data:`PROVIDERS` in order of preference (CPU by default);
    asking for one that this ONNX Runtime build lacks is an error, not a silent fallback.
    ``optimize=False`` disables ONNX Runtime's own graph optimizations (used by tests, so that
    ORT's fusions cannot hide one that tfgraph failed to do). ``checking=True`` (a parity
    check's few runs) skips weight prepacking where it is a layout change only (float
    weights); a quantized graph's kernels are chosen by prepacking, so it keeps it.
    ``spinning=False``: the intra-op threads sleep between runs instead of spin-waiting (a
    speculative target and its draft, whose sessions alternate on the same cores).
    """

    def __init__(
        self,
        path: str | Path,
        providers: Sequence[str] = ("cpu",),
        *,
        optimize: bool = True,
        threads: int | None = None,
        checking: bool = False,
        spinning: bool = True,
    ) -> None:
        import onnxruntime as ort

        self.path, self.manifest = checked_model(path)
        if ((self.manifest or {}).get("kv_layout") or {}).get("kind") == "paged":
            raise TfgraphError(
                f"'{path}' has a paged KV cache (PagedAttention: ONNX Runtime's CUDA provider "
                "only), and tfgraph's runtime has no block allocator yet; export it without "
                "--kv-layout paged to run it with tfgraph"
            )
        self.max_positions = (self.manifest or {}).get("max_positions")
        self.providers, self.threads = tuple(providers), threads
        available = ort.get_available_providers()
        chosen = []
        for name in providers:
            if name not in PROVIDERS:
                raise TfgraphError(f"unknown provider '{name}': choose from {', '.join(PROVIDERS)}")
            if PROVIDERS[name] not in available:
                raise TfgraphError(
                    f"provider '{name}' is not in this ONNX Runtime build (available: "
                    f"{', '.join(available)}); install tfgraph[gpu] on a CUDA machine"
                )
            chosen.append(PROVIDERS[name])
        options = ort.SessionOptions()
        options.log_severity_level = 4  # errors come back as one line (_run)
        if not optimize:
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        if threads:
            options.intra_op_num_threads = threads
            options.inter_op_num_threads = 1
        if not spinning:
            # two sessions taking turns (a speculative target and its draft): an idle one's
            # intra-op threads would spin-wait on the cores the other runs on (measured on 2
            # cores, the reference model and its draft: the target's one-token step 22 ms with
            # spinning vs 6.9 ms without)
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._checking = checking
        self.prepacked = not checking or _quantized(self.path)
        if not self.prepacked:
            # the weights are read in place (memory-mapped) instead of copied into packed
            # buffers: the same kernels pack per call (measured, 1.1B Llama fp32: the session
            # opens in 0.04 s instead of 14 s; logits differ by 1.2e-5 between the two)
            options.add_session_config_entry("session.disable_prepacking", "1")
        disabled = [*ALWAYS_DISABLED, *self._target_session().disabled_optimizers]
        try:
            self._session = ort.InferenceSession(
                str(self.path), options, providers=chosen, disabled_optimizers=disabled
            )
        except Exception as exc:
            raise TfgraphError(
                f"ONNX Runtime cannot load '{self.path}': {first_line(exc)}; if the file is "
                "damaged or incomplete, export it again"
            ) from exc
        self.input_names = [i.name for i in self._session.get_inputs()]
        self.output_names = [o.name for o in self._session.get_outputs()]
        self._input_types = {i.name: i.type for i in self._session.get_inputs()}
        self._input_shapes = {i.name: i.shape for i in self._session.get_inputs()}
        self._output_types = {o.name: o.type for o in self._session.get_outputs()}
        self._output_shapes = {o.name: o.shape for o in self._session.get_outputs()}
        self._kept_binding = None  # (batch, weak refs to the pasts, binding, bound names): _binding
        self.signature = self._read_signature()
        self._device = "cuda" if chosen[0] == PROVIDERS["cuda"] else "cpu"
        self._optimize = optimize
        logger.info("opened %s with %s", self.path, chosen)

    def _target_session(self):
        """The session settings of the artifact's target (none stated: the defaults)."""
        from tfgraph.exporters.targets import SessionSettings, get_target

        name = ((self.manifest or {}).get("target") or {}).get("name")
        if name is None:
            return SessionSettings()
        try:
            return get_target(name).session
        except TfgraphError:  # a target this tfgraph does not have: run with the defaults
            return SessionSettings()

    def _read_signature(self) -> contract.Signature:
        """Roles from ``manifest.json`` (this file's entry), else from the model's metadata."""
        if self.manifest is not None:
            # the step graph is the manifest's model.onnx entry wherever the flavour saved it
            parts = Path(step_file(self.manifest)).parts
            step = self.path.parts[-len(parts) :] == parts
            name = contract.MODEL_FILE if step else self.path.name
            stated = contract.signature_from_manifest(self.manifest, name)
            if stated is not None:
                return stated

        def triples(values):
            return [
                (v.name, v.type, [d if isinstance(d, int) else str(d) for d in v.shape])
                for v in values
            ]

        meta = self._session.get_modelmeta().custom_metadata_map
        return contract.build_signature(
            triples(self._session.get_inputs()), triples(self._session.get_outputs()), meta
        )

    @property
    def ort_session(self):
        """The underlying ``onnxruntime.InferenceSession`` (IO binding, metadata)."""
        return self._session

    @property
    def device(self) -> str:
        return self._device

    def sibling(self, file: str) -> Session:
        return Session(
            self.path.parent / file, self.providers, optimize=self._optimize,
            threads=self.threads, checking=self._checking,
        )  # fmt: skip

    @staticmethod
    def to_numpy(value) -> np.ndarray:
        return value if isinstance(value, np.ndarray) else value.numpy()

    # -- the cache ---------------------------------------------------------------------------
    def new_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache for ``batch`` rows; a shared-buffer artifact preallocates room for
        ``capacity`` positions (prompt + new tokens), once."""
        import onnxruntime as ort

        shared = self.signature.shared_buffer
        room = capacity if shared else 0
        values, host = {}, {}
        for port in self.signature.inputs_with(*_PAST_ROLES):
            shape = self._input_shapes[port.name]
            dtype = _ORT_DTYPES.get(self._input_types[port.name], np.float32)
            if port.role in contract.STATE_ROLES:
                host[port.key] = state_zeros(batch, shape, dtype)
            else:
                host[port.key] = np.zeros((batch, shape[1], room, shape[3]), dtype)
            # on the CPU the OrtValue shares the array's memory (no copy)
            values[port.key] = ort.OrtValue.ortvalue_from_numpy(host[port.key])
        return KVCache(values, 0, capacity if shared else None, host=host if shared else None)

    def rows(self, cache: KVCache, start: int, stop: int, lengths) -> KVCache:
        """Rows ``start:stop`` of a shared-buffer ``cache`` as a batch of their own, over the
        same memory (a slice of the leading axis is contiguous: ONNX Runtime writes the rows
        in place), each at its own past length."""
        import onnxruntime as ort

        if cache.host is None or self._device != "cpu":
            raise TfgraphError(
                "rows of a KV cache need a preallocated CPU buffer (kv_layout shared, CPU provider)"
            )
        lengths = np.asarray(lengths, np.int64)
        if lengths.shape != (stop - start,):
            raise TfgraphError(f"one past length per row: {stop - start}, got {lengths.shape}")
        values = {
            key: ort.OrtValue.ortvalue_from_numpy(array[start:stop])
            for key, array in cache.host.items()
        }
        return KVCache(values, int(lengths.max(initial=0)), cache.capacity, lengths)

    def step(
        self, feeds: Mapping[RoleKey, object], cache: KVCache, new_tokens: int
    ) -> tuple[dict[RoleKey, object], KVCache]:
        """One step with IO binding: the cache never travels through numpy. A shared buffer is
        bound as both past and present (the kernel appends in place), and the binding is
        kept for the next step over the same buffer (:meth:`_binding`); otherwise the
        presents become the next step's pasts. The logits come back in a fresh numpy array
        ONNX Runtime writes into (no copy)."""
        shared = self.signature.shared_buffer
        binding, bound = self._binding(cache, _batch_of(feeds))
        for port in self.signature.inputs:
            if port.role in _PAST_ROLES:
                continue  # bound by _binding
            if port.role == contract.PAST_LENGTH:
                binding.bind_cpu_input(port.name, np.array([cache.length], np.int64))
                continue
            if port.role == contract.PAST_LENGTHS:  # each row's own (in-flight batching)
                binding.bind_cpu_input(port.name, cache.row_lengths(_batch_of(feeds)))
                continue
            value = feeds.get(port.key)
            if value is None:
                raise TfgraphError(f"the model also needs input '{port.name}' ({port.role})")
            if isinstance(value, np.ndarray):
                binding.bind_cpu_input(port.name, np.ascontiguousarray(value))
            else:  # an OrtValue (an encoder's cross-attention K/V): bound without a copy
                binding.bind_ortvalue_input(port.name, value)
        outputs, fetched = self._bind_outputs(binding, bound, cache, feeds, new_tokens)
        self._run(lambda: self._session.run_with_iobinding(binding))
        if fetched:  # ONNX Runtime returns the outputs in the order they were first bound
            values = dict(zip(bound, binding.get_outputs(), strict=True))
            for port in self.signature.outputs:
                outputs.setdefault(port.key, values[port.name])
        if shared:
            lengths = None if cache.lengths is None else np.asarray(cache.lengths) + new_tokens
            values = dict(cache.values)
            values.update(
                {
                    (_STATE_PAST[p.role], p.layer): outputs[p.key]
                    for p in self.signature.outputs
                    if p.role in _STATE_PAST
                }
            )
            length = cache.length + new_tokens
            return outputs, KVCache(values, length, cache.capacity, lengths, cache.host)
        next_values = {
            (_PRESENT_PAST[p.role], p.layer): outputs[p.key]
            for p in self.signature.outputs
            if p.role in _PRESENT_PAST
        }
        return outputs, KVCache(next_values, cache.length + new_tokens)

    def _binding(self, cache: KVCache, batch: int):
        """An IO binding with ``cache``'s buffers bound as past (and, for a shared buffer, as
        present). The last shared-buffer binding is kept (weak references to the buffers it
        binds) and reused while a step runs over the very same buffers: a generation loop
        binds its cache once, not 2 × layers values per token. → (binding, the names of the
        outputs bound so far, in binding order: the order of its outputs)."""
        import weakref

        shared = self.signature.shared_buffer
        pasts = [cache.values[p.key] for p in self.signature.inputs if p.role in _PAST_ROLES]
        kept = self._kept_binding
        if shared and kept is not None and kept[0] == batch and len(kept[1]) == len(pasts):
            if all(ref() is value for ref, value in zip(kept[1], pasts, strict=True)):
                return kept[2], kept[3]
        binding, bound = self._session.io_binding(), []
        for port in self.signature.inputs:
            if port.role in _PAST_ROLES:
                binding.bind_ortvalue_input(port.name, cache.values[port.key])
        for port in self.signature.outputs:
            past = (_PRESENT_PAST.get(port.role), port.layer)
            if shared and past in cache.values and port.role not in _STATE_PAST:
                binding.bind_ortvalue_output(port.name, cache.values[past])  # appended in place
                bound.append(port.name)
        self._kept_binding = None
        if shared and self._device == "cpu":
            try:
                self._kept_binding = (batch, [weakref.ref(v) for v in pasts], binding, bound)
            except TypeError:  # a runner value without weak references: not kept
                pass
        return binding, bound

    def _bind_outputs(
        self, binding, bound: list, cache: KVCache, feeds, new_tokens: int
    ) -> tuple[dict, bool]:
        """Binds the outputs a step does not alias to its cache: the logits to a fresh
        numpy array where their shape is known (→ {key: array}), the others to the CPU,
        allocated by ONNX Runtime (→ fetched: True); ``bound``: the binding's output names in
        the order first bound, extended."""
        shared, outputs, fetched = self.signature.shared_buffer, {}, False
        for port in self.signature.outputs:
            past = (_PRESENT_PAST.get(port.role), port.layer)
            if shared and past in cache.values and port.role not in _STATE_PAST:
                outputs[port.key] = cache.values[past]  # bound by _binding
                continue
            shape = self._output_shapes.get(port.name)
            dtype = _ORT_DTYPES.get(self._output_types.get(port.name))
            if port.role == contract.LOGITS and self._device == "cpu" and dtype is not None:
                if shape is not None and len(shape) == 3 and isinstance(shape[2], int):
                    import onnxruntime as ort

                    array = np.empty((_batch_of(feeds), new_tokens, shape[2]), dtype)
                    binding.bind_ortvalue_output(port.name, ort.OrtValue.ortvalue_from_numpy(array))
                    outputs[port.key] = array
                    bound += [] if port.name in bound else [port.name]
                    continue
            binding.bind_output(port.name, "cpu")  # a new value each run, never the last one
            bound += [] if port.name in bound else [port.name]
            fetched = True
        return outputs, fetched

    def run(self, inputs: Mapping[str, object], *, native: bool = False) -> dict[str, object]:
        """Run on numpy arrays or torch tensors; returns ``{output name: numpy array}`` (with
        ``native``, ``OrtValue`` objects that stay where ONNX Runtime put them)."""
        missing = [n for n in self.input_names if n not in inputs]
        unknown = [n for n in inputs if n not in self.input_names]
        if missing or unknown:
            raise TfgraphError(
                f"inputs do not match the model: missing {missing}, unknown {unknown}; "
                f"it takes {self.input_names}"
            )
        feeds = {name: self.check_input(name, inputs[name]) for name in self.input_names}
        if native:
            binding = self._session.io_binding()
            for name, value in feeds.items():
                binding.bind_cpu_input(name, np.ascontiguousarray(value))
            for name in self.output_names:
                binding.bind_output(name, "cpu")
            self._run(lambda: self._session.run_with_iobinding(binding))
            return dict(zip(self.output_names, binding.get_outputs(), strict=True))
        outputs = self._run(lambda: self._session.run(None, feeds))
        return dict(zip(self.output_names, outputs, strict=True))

    def _run(self, run):
        """ONNX Runtime's own refusals (an index outside a table, a shape its kernel rejects)
        as one line that names the model, not a traceback."""
        try:
            return run()
        except Exception as exc:
            # its own exception types, or a plain RuntimeError ("Error in execution: …") from
            # run_with_iobinding
            ours = type(exc).__module__.split(".")[0] == "onnxruntime"
            if not ours and not (type(exc) is RuntimeError and "Error in execution" in str(exc)):
                raise
            hint = " (token ids must be below the vocabulary size)" if "Gather" in str(exc) else ""
            raise TfgraphError(
                f"ONNX Runtime could not run '{self.path}': {first_line(exc)}; check the "
                f"inputs{hint}"
            ) from exc

    def input_dtype(self, name: str) -> np.dtype | None:
        """The numpy dtype input ``name`` takes (None for a type numpy does not name here)."""
        want = _ORT_DTYPES.get(self._input_types[name])
        return None if want is None else np.dtype(want)

    def check_input(self, name: str, value: object) -> np.ndarray:
        """``value`` as the numpy array input ``name`` takes: dtype cast within its kind; rank,
        static dims and positions (``max_positions``) checked, naming the input."""
        if hasattr(value, "detach"):  # torch.Tensor, without importing torch here
            value = value.detach().cpu().numpy()
        value = np.asarray(value)
        want = _ORT_DTYPES.get(self._input_types[name])
        if want is not None and value.dtype != want:
            if value.dtype.kind != np.dtype(want).kind:
                raise TfgraphError(
                    f"input '{name}' has dtype {value.dtype}, the model wants {np.dtype(want)}"
                )
            value = value.astype(want)
        self._check_shape(name, value.shape)
        return value

    def _check_shape(self, name: str, got: tuple[int, ...]) -> None:
        want = self._input_shapes.get(name)
        if want is None:
            return
        if len(got) != len(want) or any(
            isinstance(w, int) and w != g for w, g in zip(want, got, strict=True)
        ):
            raise TfgraphError(
                f"input '{name}' has shape {_shape_text(got)}, the model wants {_shape_text(want)}"
            )
        limit = self.max_positions
        for dim, size in zip(want, got, strict=True):
            if limit is not None and dim in SEQUENCE_DIMS and size > limit:
                raise TfgraphError(
                    f"input '{name}' has {size} positions ({dim}), more than the {limit} the "
                    "model supports (max_positions in manifest.json); shorten it"
                )


RUNNERS["onnxruntime"] = Session
