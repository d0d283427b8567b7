"""The Triton server's own environment: ``tritonserver`` and a NumPy 1 for its Python backend.

    python -m tfgraph.runtime.serving.install            # create or update it (idempotent)
    python -m tfgraph.runtime.serving.install --check    # where it is and what it holds

Why apart from tfgraph's environment: the ``nvidia-pytriton`` 0.7.0 wheel's ``tritonserver``
2.51 ships a Python-backend stub built with a pybind11 (``numpy.core.multiarray``, internals v4)
that reads NumPy 1's array-descriptor layout. With NumPy 2 imported in the stub every tensor
crosses with a wrong byte size: an FP32 output arrives empty, a BYTES input kills the stub
(measured, numpy 2.4.6). That is why the wheel requires ``numpy<2``; tfgraph itself does not,
and ``pip install -e .`` gives NumPy 2. So the server side gets a virtual environment of its own
(its ``numpy`` is the only one the stub ever imports) and tfgraph's environment keeps its NumPy.

The stub is an embedded Python that runs *isolated* (``PYTHONPATH`` is ignored) and finds its
prefix by looking up ``python3`` on ``PATH``; it imports ``triton_python_backend_utils``, hence
NumPy, before a model's code runs. :mod:`.launcher` therefore puts this environment's ``bin/``
first on the server's ``PATH``: the stub gets this environment's site-packages. A model then
*appends* its ``python_paths`` (tfgraph's environment, for ``tfgraph`` itself and anything not
installed here, e.g. transformers for a tokenizer); what is installed here comes first.

Layout (a venv at ``$TFGRAPH_TRITON_ENV``, by default ``<sys.prefix>/tfgraph-triton``: inside
the virtual environment tfgraph runs in, removed with it):

- ``bin/python3``: the stub's interpreter, the same Python version and build as ours;
- its site-packages: ``numpy<2`` and the NumPy-compiled packages tfgraph's runtime imports
  (onnxruntime, onnx, onnx-ir, ml_dtypes; versions as tfgraph requires them), and
  ``nvidia-pytriton`` installed without its dependencies (only its binaries are used);
- ``tfgraph-triton.json``, written last: what was installed, for which Python.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tfgraph.errors import TfgraphError

logger = logging.getLogger(__name__)

INSTALL_COMMAND = "python -m tfgraph.runtime.serving.install"
ENV_VAR = "TFGRAPH_TRITON_ENV"
MARKER = "tfgraph-triton.json"
TRITON = "nvidia-pytriton==0.7.0"  # tritonserver 2.51: stubs for Python 3.8-3.13
NUMPY = "numpy<2"  # the stub's pybind11 (see above)
# tfgraph's runtime imports these; each is compiled against NumPy: the server has its own
RUNTIME = ("onnxruntime", "onnx", "onnx-ir", "ml-dtypes")
FORMAT = 1  # bumped when the layout or the marker changes


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements() -> list[str]:
    """What ``pip`` installs into the server environment, besides ``nvidia-pytriton``.

    ``numpy<2`` and the runtime packages with tfgraph's own version specifiers (from the
    installed distribution's metadata; bare names when tfgraph is not installed)."""
    from importlib import metadata

    pinned = {}
    try:
        declared = metadata.requires("tfgraph") or []
    except metadata.PackageNotFoundError:
        declared = []
    for line in declared:
        requirement, _, marker = line.partition(";")
        if "extra" in marker:
            continue
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
        if match and _normalize(match.group(1)) in RUNTIME:
            pinned[_normalize(match.group(1))] = requirement.strip().replace(" ", "")
    return [NUMPY, *(pinned.get(name, name) for name in RUNTIME)]


def default_path() -> Path:
    """``$TFGRAPH_TRITON_ENV``, else ``<sys.prefix>/tfgraph-triton``."""
    given = os.environ.get(ENV_VAR)
    return Path(given).expanduser() if given else Path(sys.prefix) / "tfgraph-triton"


def _python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


@dataclass(frozen=True)
class ServerEnv:
    """An installed server environment (read from its ``tfgraph-triton.json``)."""

    root: Path
    bin_dir: Path  # first on the server's PATH: the stub's python3
    site_packages: Path  # numpy<2 …, and nvidia-pytriton's pytriton/ + nvidia_pytriton.libs/
    libdir: str | None  # the directory of its libpython (a shared build), for LD_LIBRARY_PATH
    python_version: str  # "3.X"
    packages: dict  # name -> version, as installed


def _missing(root: Path, why: str) -> TfgraphError:
    return TfgraphError(
        f"no Triton server environment at {root} ({why}): install it with `{INSTALL_COMMAND}`"
    )


def find_server_env(root: Path | None = None) -> ServerEnv:
    """The server environment at ``root`` (default :func:`default_path`), or a one-line
    TfgraphError naming the command that installs it."""
    root = Path(root) if root is not None else default_path()
    marker = root / MARKER
    if not marker.is_file():
        why = "not installed" if not root.exists() else f"{MARKER} missing: incomplete"
        raise _missing(root, why)
    try:
        info = json.loads(marker.read_text())
        env = ServerEnv(
            root=root,
            bin_dir=Path(info["bin_dir"]),
            site_packages=Path(info["site_packages"]),
            libdir=info.get("libdir"),
            python_version=info["python_version"],
            packages=dict(info["packages"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise _missing(root, f"unreadable {MARKER}: {exc}") from None
    if info.get("format") != FORMAT:
        raise _missing(root, "made by another tfgraph version")
    if env.python_version != _python_version():
        raise _missing(root, f"made for Python {env.python_version}, this is {_python_version()}")
    if not (env.bin_dir / "python3").exists() or not env.site_packages.is_dir():
        raise _missing(root, "its Python is gone")
    return env


def _run(cmd: list[str], what: str) -> None:
    logger.info("+ %s", " ".join(cmd))
    code = subprocess.call(cmd)
    if code != 0:
        raise TfgraphError(f"{what} failed (exit {code}); its output is above")


_PROBE = """\
import json, sys, sysconfig
from importlib import metadata
names = sys.argv[1:]
print(json.dumps({
    "bin_dir": sysconfig.get_path("scripts"),
    "site_packages": sysconfig.get_path("purelib"),
    "libdir": sysconfig.get_config_var("LIBDIR")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") else None,
    "python_version": "%d.%d" % sys.version_info[:2],
    "packages": {n: metadata.version(n) for n in names},
}))
"""


def install_server_env(root: Path | None = None, *, force: bool = False) -> ServerEnv:
    """Create (or bring up to date) the server environment at ``root``; return it.

    Does nothing when its marker says it already holds these requirements for this Python.
    Needs ``pip`` to reach a package index (``nvidia-pytriton`` is a 55 MB wheel)."""
    root = Path(root) if root is not None else default_path()
    wanted = [*requirements(), TRITON]
    if not force:
        try:
            env = find_server_env(root)
        except TfgraphError:
            pass
        else:
            if json.loads((root / MARKER).read_text()).get("requirements") == wanted:
                logger.info("Triton server environment at %s is up to date", root)
                return env
    if root.resolve() == Path(sys.prefix).resolve():
        raise TfgraphError(f"{root} is the environment tfgraph runs in: choose another path")
    is_venv = (root / "pyvenv.cfg").is_file()
    if root.exists() and not is_venv and any(root.iterdir()):
        raise TfgraphError(f"{root} exists and is not a virtual environment: remove it first")
    if root.exists() and (force or not is_venv):
        shutil.rmtree(root)
    if root.exists():
        (root / MARKER).unlink(missing_ok=True)  # incomplete until written again
    if not (root / "pyvenv.cfg").is_file():
        _run([sys.executable, "-m", "venv", str(root)], "creating the virtual environment")
    python = str(root / "bin" / "python3")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--quiet"]
    _run([*pip, *requirements()], "installing the server's Python packages")
    # only its binaries: its Python dependencies (PyTriton's own proxy) are not used
    _run([*pip, "--no-deps", "--no-warn-conflicts", TRITON], "installing nvidia-pytriton")
    names = [re.match(r"[A-Za-z0-9._-]+", r).group(0) for r in wanted]
    probe = subprocess.run(
        [python, "-c", _PROBE, *names], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise TfgraphError(f"the new server environment does not run: {last}")
    info = json.loads(probe.stdout)
    if int(info["packages"]["numpy"].split(".")[0]) >= 2:
        raise TfgraphError(f"the server environment got numpy {info['packages']['numpy']}")
    info.update(format=FORMAT, requirements=wanted)
    (root / MARKER).write_text(json.dumps(info, indent=2) + "\n")
    try:
        find_tritonserver(root)  # the wheel has the binary and a stub for this Python
    except BaseException:
        (root / MARKER).unlink(missing_ok=True)
        raise
    return find_server_env(root)


STUB = "triton_python_backend_stub"


@dataclass(frozen=True)
class TritonInstall:
    """Where the server environment keeps the server and the Python its stub runs."""

    binary: Path  # pytriton/tritonserver/bin/tritonserver
    libs_dir: Path  # nvidia_pytriton.libs/: the binary's bundled shared libraries
    backends_dir: Path  # pytriton/tritonserver/backends/ (python/ without its stub)
    stub: Path  # python_backend_stubs/3.X/triton_python_backend_stub
    python_version: str  # "3.X" the stub was chosen for: the server environment's
    python_bin: Path  # the server environment's bin/: first on PATH, the stub's python3
    python_libdir: str | None  # where its libpython is (a shared build), else None


def find_tritonserver(root: Path | None = None) -> TritonInstall:
    """The ``tritonserver`` of the server environment (:func:`find_server_env`),
    or a one-line TfgraphError naming the command that installs it."""
    env = find_server_env(root)
    package = env.site_packages / "pytriton"
    tree = package / "tritonserver"
    install = TritonInstall(
        binary=tree / "bin" / "tritonserver",
        libs_dir=env.site_packages / "nvidia_pytriton.libs",
        backends_dir=tree / "backends",
        stub=tree / "python_backend_stubs" / env.python_version / STUB,
        python_version=env.python_version,
        python_bin=env.bin_dir,
        python_libdir=env.libdir,
    )
    for what, path in [
        ("tritonserver binary", install.binary),
        ("bundled libraries", install.libs_dir),
        ("Python backend", install.backends_dir / "python"),
        (f"Python {env.python_version} backend stub", install.stub),
    ]:
        if not path.exists():
            raise TfgraphError(
                f"the server environment at {env.root} has no {what} at {path}: reinstall it "
                f"(`{INSTALL_COMMAND} --force`) under a Python nvidia-pytriton ships a stub for"
            )
    return install


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tfgraph.runtime.serving.install",
        description="Install tritonserver and the Python its backend runs (numpy<2) into a "
        "virtual environment of their own, apart from tfgraph's.",
    )
    parser.add_argument(
        "--path", type=Path, help=f"where (default: ${ENV_VAR}, else <sys.prefix>/tfgraph-triton)"
    )
    parser.add_argument("--force", action="store_true", help="recreate it from scratch")
    parser.add_argument("--check", action="store_true", help="only say whether it is installed")
    args = parser.parse_args(argv)
    # the command shows the library's progress (each pip step) on stderr
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.check:
            env = find_server_env(args.path)
        else:
            env = install_server_env(args.path, force=args.force)
    except TfgraphError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    held = ", ".join(f"{name} {version}" for name, version in env.packages.items())
    print(f"Triton server environment: {env.root} (Python {env.python_version}: {held})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
