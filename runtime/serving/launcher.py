"""Start NVIDIA Triton Inference Server from the ``nvidia-pytriton`` wheel, on the CPU.

The wheel bundles a ``tritonserver`` binary, its shared libraries and the Python backend;
PyTriton's own Python layer is not used. The wheel lives in the *server environment*
(:mod:`.install`: ``python -m tfgraph.runtime.serving.install``), a virtual environment apart from
tfgraph's that holds the ``numpy<2`` the backend's stub needs. What the raw binary needs here:

- ``LD_LIBRARY_PATH`` with the wheel's ``nvidia_pytriton.libs/`` (and the server
  environment's ``libpython``, so the Python-backend stub embeds that Python);
- a ``--backend-directory`` whose ``python/`` holds ``triton_python_backend_stub`` built for
  its ``3.X``: the wheel keeps the stubs apart, so a copy of ``backends/`` is made;
- a model's ``model.py`` runs in the stub, an embedded, isolated Python (``PYTHONPATH`` is
  ignored) that finds its prefix through ``python3`` on ``PATH``: :func:`server_env` puts the
  server environment's ``bin/`` first, so the stub's site-packages (and the NumPy that
  ``triton_python_backend_utils`` imports before any model code runs) are that
  environment's. Models carry :func:`python_site_paths` (tfgraph's environment) in their
  ``config.pbtxt`` ``parameters`` and *append* them with ``site.addsitedir`` in
  ``initialize``, for ``tfgraph`` itself and anything the server environment lacks.

:class:`TritonServer` is a context manager that starts the server on loopback ports, waits
until it is ready and always stops it (and its stub processes) on exit.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import re
import shutil
import signal
import site
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import weakref
from collections.abc import Iterable
from itertools import count
from pathlib import Path

from tfgraph.errors import TfgraphError
from tfgraph.runtime.serving.install import STUB, TritonInstall, find_tritonserver

logger = logging.getLogger(__name__)

_TAIL_LINES = 40
_server_ids = count()


def python_site_paths() -> list[str]:
    """Directories a Python-backend model adds to ``sys.path`` to import what we import.

    The running interpreter's site-packages (a virtual environment's included) and, when
    tfgraph is not installed inside them (editable install or a checkout), the directory
    holding the ``tfgraph`` package. Append them with ``site.addsitedir`` so that ``.pth``
    files run too (an editable install maps ``tfgraph.runtime`` etc. through one), *after* the
    stub's own site-packages: the server environment's ``numpy<2`` and runtime packages come
    first, tfgraph and anything the server environment lacks from here.
    """
    candidates = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        candidates.append(site.getusersitepackages())
    paths = [p for p in dict.fromkeys(candidates) if os.path.isdir(p)]
    repo = Path(__file__).resolve().parents[2]  # tfgraph/serving/launcher.py → the repo
    if not any(repo.is_relative_to(Path(p).resolve()) for p in paths):
        paths.append(str(repo))
    return paths


_backends_copies: dict[TritonInstall, Path] = {}


def _backends_with_stub(install: TritonInstall) -> Path:
    """A per-process copy of the wheel's ``backends/`` with the stub in ``python/``."""
    if install in _backends_copies and _backends_copies[install].exists():
        return _backends_copies[install]
    tmp = Path(tempfile.mkdtemp(prefix="tfgraph-triton-backends-"))
    atexit.register(shutil.rmtree, tmp, True)
    backends = tmp / "backends"
    shutil.copytree(install.backends_dir, backends, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(install.stub, backends / "python" / STUB)
    _backends_copies[install] = backends
    return backends


def _library_path(install: TritonInstall) -> str:
    """``LD_LIBRARY_PATH`` for the server and the stub: bundled libs, then the stub's
    libpython."""
    dirs = [str(install.libs_dir)]
    if install.python_libdir and os.path.isdir(install.python_libdir):
        dirs.append(install.python_libdir)
    if os.environ.get("LD_LIBRARY_PATH"):
        dirs.append(os.environ["LD_LIBRARY_PATH"])
    return os.pathsep.join(dirs)


def server_env(install: TritonInstall) -> dict[str, str]:
    """The environment for ``tritonserver``: the stub must embed the server environment's
    Python.

    The stub links ``libpython3.X.so`` (found through ``LD_LIBRARY_PATH``: the server
    environment's first when it is a shared build) and, as an embedded interpreter, finds its
    prefix by looking up ``python3`` on ``PATH``: with the server environment's ``bin/`` first
    it gets that Python's standard library and the environment's site-packages (``numpy<2``,
    which ``triton_python_backend_utils`` imports). Otherwise the stub may pair a libpython
    with another Python's standard library (``No module named '_struct'``), find no numpy, or
    find tfgraph's NumPy 2, with which every tensor crosses with a wrong size.
    """
    path = os.environ.get("PATH", os.defpath)
    return {
        **os.environ,
        "LD_LIBRARY_PATH": _library_path(install),
        "PATH": os.pathsep.join([str(install.python_bin), path]),
    }


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@functools.cache
def _address_flags(install: TritonInstall, host: str = "127.0.0.1") -> tuple[str, ...]:
    """``--http-address``/``--grpc-address``/``--metrics-address`` where the binary has them."""
    result = subprocess.run(
        [str(install.binary), "--help"],
        env=server_env(install),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    text = result.stdout + result.stderr
    flags = ("--http-address", "--grpc-address", "--metrics-address")
    return tuple(f"{flag}={host}" for flag in flags if flag in text)


def server_command(
    install: TritonInstall,
    repository: Path,
    *,
    shm_prefix: str,
    ports: tuple[int, int, int],
    metrics: bool = True,
    host: str = "127.0.0.1",
    model_control: str = "explicit",
    models: Iterable[str] = (),
    stop_timeout: float = 5,
) -> list[str]:
    """The ``tritonserver`` command line: ``repository`` on ``ports`` (HTTP, gRPC, metrics)
    at ``host``, the backends copy with the stub, the Python backend's shared memory named
    with ``shm_prefix`` (names collide between servers otherwise)."""
    http_port, grpc_port, metrics_port = ports
    return [
        str(install.binary),
        f"--model-repository={Path(repository).resolve()}",
        f"--backend-directory={_backends_with_stub(install)}",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        f"--allow-metrics={'true' if metrics else 'false'}",
        *(["--allow-gpu-metrics=false", "--allow-cpu-metrics=false"] if metrics else []),
        *_address_flags(install, host),
        f"--model-control-mode={model_control}",
        *[f"--load-model={name}" for name in models],
        "--exit-on-error=true",
        f"--exit-timeout-secs={max(1, int(stop_timeout))}",
    ]


def _kill_group(process: subprocess.Popen, grace_s: float, shm_prefix: str) -> None:
    """SIGTERM the server's process group, SIGKILL it after ``grace_s``; reap the server.

    Then remove the Python backend's shared-memory regions (named with ``shm_prefix``),
    which a server killed while loading a model leaves in ``/dev/shm``.
    """
    pgid = process.pid  # started with start_new_session: its own group
    if process.poll() is None:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            logger.warning("tritonserver (pid %d) ignored SIGTERM; killing it", pgid)
    try:  # stubs left in the group, or a server that ignored SIGTERM
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    shm = Path("/dev/shm")
    if shm.is_dir():
        for region in shm.glob(f"{shm_prefix}*"):
            region.unlink(missing_ok=True)


class TritonServer:
    """A ``tritonserver`` on loopback ports serving ``repository``; a context manager.

    ``model_control``: ``"explicit"`` (load only ``load`` at startup; :meth:`load` and
    :meth:`unload` work) or ``"none"`` (load every model in the repository). A model that
    fails to load stops the server (``--exit-on-error``): the TfgraphError carries the tail
    of its log. The server and its stub processes are always stopped on exit.
    """

    def __init__(
        self,
        repository: Path,
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        model_control: str = "explicit",
        load: Iterable[str] = (),
        log_file: Path | None = None,
        startup_timeout: float = 60,
        stop_timeout: float = 5,
        metrics: bool = False,
    ):
        if model_control not in ("explicit", "none"):
            raise TfgraphError(f"model_control must be 'explicit' or 'none', not {model_control!r}")
        self.repository = Path(repository)
        self.model_control = model_control
        self.models = tuple(load)
        if self.models and model_control != "explicit":
            raise TfgraphError("load=... needs model_control='explicit'")
        self.http_port = http_port or _free_port()
        self.grpc_port = grpc_port or _free_port()
        self.metrics_port = _free_port()
        self.metrics_enabled = metrics  # Prometheus /metrics on loopback (metrics())
        self.startup_timeout = startup_timeout
        self.stop_timeout = stop_timeout
        self.process: subprocess.Popen | None = None
        self._tmp: Path | None = None
        self._log_path = Path(log_file) if log_file is not None else None
        self._final_log: str | None = None
        self._finalizer: weakref.finalize | None = None
        self._shm_prefix = f"tfgraph_{os.getpid()}_{next(_server_ids)}_"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def __enter__(self) -> TritonServer:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def command(self, install: TritonInstall) -> list[str]:
        """The ``tritonserver`` command line."""
        return server_command(
            install,
            self.repository,
            shm_prefix=self._shm_prefix,
            ports=(self.http_port, self.grpc_port, self.metrics_port),
            metrics=self.metrics_enabled,
            model_control=self.model_control,
            models=self.models,
            stop_timeout=self.stop_timeout,
        )

    def start(self) -> None:
        """Start the server and wait until ``/v2/health/ready``; stop it if that fails."""
        if self.process is not None:
            raise TfgraphError("this TritonServer was already started")
        if not self.repository.is_dir():
            raise TfgraphError(f"model repository {self.repository} is not a directory")
        install = find_tritonserver()
        env = server_env(install)
        cmd = self.command(install)
        if self._log_path is None:
            self._tmp = Path(tempfile.mkdtemp(prefix="tfgraph-triton-"))
            self._log_path = self._tmp / "tritonserver.log"
        logger.debug("starting %s", " ".join(cmd))
        started = time.monotonic()
        with open(self._log_path, "wb") as log:
            self.process = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        # Triton itself waits up to --exit-timeout-secs for models to unload
        grace = self.stop_timeout + 2
        self._finalizer = weakref.finalize(self, _kill_group, self.process, grace, self._shm_prefix)
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        logger.info(
            "tritonserver ready on %s (HTTP), %s (gRPC) after %.1f s",
            self.http_url,
            self.grpc_url,
            time.monotonic() - started,
        )

    def _wait_ready(self, started: float) -> None:
        deadline = started + self.startup_timeout
        while True:
            code = self.process.poll()
            if code is not None:
                raise TfgraphError(
                    f"tritonserver exited with code {code} during startup; "
                    f"log tail:\n{self._tail()}"
                )
            if self._get("/v2/health/ready") == 200:
                return
            if time.monotonic() > deadline:
                raise TfgraphError(
                    f"tritonserver not ready after {self.startup_timeout:g} s; "
                    f"log tail:\n{self._tail()}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the server and its process group (SIGTERM, then SIGKILL). Idempotent."""
        if self.process is None:
            return
        if self._finalizer is not None:
            self._finalizer()  # runs _kill_group once
        if self._final_log is None:
            self._final_log = self.log_text()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def log_text(self) -> str:
        """Everything the server (and its stubs) wrote so far."""
        if self._final_log is not None:
            return self._final_log
        if self._log_path is None or not self._log_path.exists():
            return ""
        return self._log_path.read_text(errors="replace")

    def _tail(self, lines: int = _TAIL_LINES) -> str:
        return "\n".join(self.log_text().rstrip().splitlines()[-lines:])

    # --- HTTP API (urllib: no client library needed) ---

    def _request(self, method: str, path: str, timeout: float = 5) -> tuple[int, str]:
        req = urllib.request.Request(f"http://{self.http_url}{path}", method=method)
        if method == "POST":
            req.data = b"{}"
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, OSError):
            return 0, ""

    def _get(self, path: str) -> int:
        return self._request("GET", path, timeout=1)[0]

    def metrics(self) -> dict[str, float]:
        """The server's metrics (started with ``metrics=True``): ``{name{labels}: value}``
        from its Prometheus text."""
        if not self.metrics_enabled:
            raise TfgraphError("this server was started without metrics (metrics=True)")
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                try:
                    out[key] = float(value)
                except ValueError:
                    continue
        return out

    def is_model_ready(self, name: str) -> bool:
        return self._get(f"/v2/models/{urllib.parse.quote(name, safe='')}/ready") == 200

    def load(self, name: str, timeout: float = 60) -> None:
        """Load (or reload) a model; a TfgraphError with Triton's reason if that fails."""
        self._repository_call(name, "load", timeout)

    def unload(self, name: str, timeout: float = 60) -> None:
        """Unload a model and wait until it no longer reports ready."""
        self._repository_call(name, "unload", timeout)
        deadline = time.monotonic() + timeout
        while self.is_model_ready(name):
            if time.monotonic() > deadline:
                raise TfgraphError(f"model {name!r} still ready {timeout:g} s after unload")
            time.sleep(0.05)

    def _repository_call(self, name: str, action: str, timeout: float) -> None:
        if self.process is None or self.process.poll() is not None:
            raise TfgraphError(f"cannot {action} {name!r}: tritonserver is not running")
        quoted = urllib.parse.quote(name, safe="")
        code, body = self._request(
            "POST", f"/v2/repository/models/{quoted}/{action}", timeout=timeout
        )
        if code != 200:
            try:
                reason = json.loads(body)["error"]
            except (ValueError, KeyError, TypeError):
                reason = body.strip() or f"HTTP {code}"
            raise TfgraphError(f"Triton could not {action} model {name!r}: {reason}")


# --- ``tfgraph tritonserver REPO``: the server in the foreground ----------------------------

_BACKEND_LINE = re.compile(r'^\s*(backend|platform)\s*:\s*"([^"]+)"', re.MULTILINE)
_PLATFORM_BACKENDS = {"tensorrt_plan": "tensorrt", "onnxruntime_onnx": "onnxruntime"}


def loadable_models(repository: Path, install: TritonInstall) -> tuple[list[str], dict[str, str]]:
    """The models of ``repository`` this server has a backend for, and the others with why
    not (the ``nvidia-pytriton`` wheel has the Python backend only: the generation models)."""
    load, skipped = [], {}
    for config in sorted(Path(repository).glob("*/config.pbtxt")):
        name = config.parent.name
        match = _BACKEND_LINE.search(config.read_text(errors="replace"))
        if match is None:
            skipped[name] = "its config.pbtxt names no backend"
            continue
        backend = _PLATFORM_BACKENDS.get(match.group(2), match.group(2))
        if (install.backends_dir / backend).is_dir():
            load.append(name)
        else:
            skipped[name] = f"no {backend} backend in this tritonserver"
    return load, skipped


def serve_foreground(
    repository: Path,
    *,
    host: str = "127.0.0.1",
    http_port: int = 8000,
    grpc_port: int = 8001,
    metrics_port: int = 8002,
    models: Iterable[str] = (),
    stop_timeout: float = 5,
) -> int:
    """Run the server environment's ``tritonserver`` on ``repository`` until it exits or this
    process is interrupted (then it and its stubs are stopped); its exit code. Its log goes
    to this process's output. What ``tfgraph tritonserver`` runs: the environment, backends
    directory and stub that :class:`TritonServer` sets up, on the given ports."""
    repository = Path(repository)
    if not repository.is_dir():
        raise TfgraphError(f"model repository {repository} is not a directory")
    install = find_tritonserver()
    shm_prefix = f"tfgraph_{os.getpid()}_{next(_server_ids)}_"
    cmd = server_command(
        install,
        repository,
        shm_prefix=shm_prefix,
        ports=(http_port, grpc_port, metrics_port),
        host=host,
        models=models,
        stop_timeout=stop_timeout,
    )
    logger.debug("starting %s", " ".join(cmd))
    process = subprocess.Popen(
        cmd, env=server_env(install), stdin=subprocess.DEVNULL, start_new_session=True
    )
    try:
        return _wait_interruptibly(process)
    finally:
        _kill_group(process, stop_timeout + 2, shm_prefix)


def _wait_interruptibly(process: subprocess.Popen, poll_s: float = 0.25) -> int:
    """``process.wait()`` in short waits. A bare ``waitpid`` is only cut short by a signal the
    kernel hands to the main thread; this process has other threads (ONNX Runtime's, torch's),
    and a Ctrl-C delivered to one of them would wait for the server to exit on its own. Between
    short waits Python runs the pending handler within ``poll_s``."""
    while True:
        try:
            return process.wait(timeout=poll_s)
        except subprocess.TimeoutExpired:
            continue
