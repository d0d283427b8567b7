"""The clients an ``optimum``-flavour artifact is made for, installed apart from tfgraph:

    python -m tfgraph.tools.peer_clients            # install both (idempotent)
    python -m tfgraph.tools.peer_clients --check    # where they are and what they hold
    python -m tfgraph.tools.peer_clients --only optimum   # or: --only transformersjs

- **Optimum** (``optimum-onnx``'s ``ORTModelForCausalLM``) pins a transformers older than
  tfgraph's (optimum-onnx 0.1.0: transformers < 4.58; tfgraph runs 5.x), so it gets a virtual
  environment of its own at ``$TFGRAPH_OPTIMUM_ENV``, by default ``<sys.prefix>/tfgraph-optimum``
  (inside the environment tfgraph runs in, removed with it, as the Triton server's is). torch
  and onnxruntime there are tfgraph's own versions (the same kernels on both sides).
- **transformers.js** (``@huggingface/transformers`` for node) goes into
  ``$TFGRAPH_TRANSFORMERSJS_DIR``, by default ``<sys.prefix>/tfgraph-transformersjs``, with
  ``npm install --ignore-scripts``: onnxruntime-node's install script only downloads GPU
  providers from outside the registry; its CPU binary is in the package itself (checked here).
  Needs ``node`` >= 18 on ``PATH``.

Each writes a marker JSON last (what was installed, for which requirements); a run whose marker
matches does nothing. :mod:`tfgraph.tools.peer_run` runs the clients on an artifact.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tfgraph.errors import TfgraphError

logger = logging.getLogger(__name__)

INSTALL_COMMAND = "python -m tfgraph.tools.peer_clients"
OPTIMUM_ENV_VAR = "TFGRAPH_OPTIMUM_ENV"
TRANSFORMERSJS_ENV_VAR = "TFGRAPH_TRANSFORMERSJS_DIR"
OPTIMUM = "optimum-onnx[onnxruntime]==0.1.0"
TRANSFORMERSJS = "@huggingface/transformers@4.3.1"
OPTIMUM_MARKER = "tfgraph-optimum.json"
TRANSFORMERSJS_MARKER = "tfgraph-transformersjs.json"
NODE_MAJOR = 18  # the oldest node transformers.js 4 runs on
FORMAT = 1  # bumped when a layout or a marker changes
_PROBED = ("optimum-onnx", "optimum", "transformers", "torch", "onnxruntime")


@dataclass(frozen=True)
class OptimumEnv:
    root: Path
    python: Path  # the environment's interpreter: runs Optimum's scripts
    packages: dict  # name -> version, as installed


@dataclass(frozen=True)
class TransformersJs:
    root: Path  # node_modules/ is inside: node run here resolves '@huggingface/transformers'
    node: str  # the node binary
    packages: dict  # name -> version, as installed


def _path(var: str, default: str) -> Path:
    given = os.environ.get(var)
    return Path(given).expanduser() if given else Path(sys.prefix) / default


def optimum_path() -> Path:
    """``$TFGRAPH_OPTIMUM_ENV``, else ``<sys.prefix>/tfgraph-optimum``."""
    return _path(OPTIMUM_ENV_VAR, "tfgraph-optimum")


def transformersjs_path() -> Path:
    """``$TFGRAPH_TRANSFORMERSJS_DIR``, else ``<sys.prefix>/tfgraph-transformersjs``."""
    return _path(TRANSFORMERSJS_ENV_VAR, "tfgraph-transformersjs")


def _same_as_ours(name: str) -> str:
    """``name==X.Y.Z``: the version tfgraph's own environment runs (its local build tag
    dropped: ``2.13.0+cpu`` resolves to the same wheel), or the bare name."""
    try:
        return f"{name}=={metadata.version(name).split('+')[0]}"
    except metadata.PackageNotFoundError:
        return name


def optimum_requirements() -> list[str]:
    return [OPTIMUM, _same_as_ours("torch"), _same_as_ours("onnxruntime")]


def _missing(what: str, root: Path, why: str) -> TfgraphError:
    return TfgraphError(f"no {what} at {root} ({why}): install it with `{INSTALL_COMMAND}`")


def _marker(root: Path, name: str, what: str) -> dict:
    marker = root / name
    if not marker.is_file():
        why = "not installed" if not root.exists() else f"{name} missing: incomplete"
        raise _missing(what, root, why)
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        raise _missing(what, root, f"unreadable {name}: {exc}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise _missing(what, root, "made by another tfgraph version")
    return info


def find_optimum(root: Path | None = None) -> OptimumEnv:
    """The Optimum environment at ``root`` (default :func:`optimum_path`), or a one-line
    TfgraphError naming the command that installs it."""
    root = Path(root) if root is not None else optimum_path()
    info = _marker(root, OPTIMUM_MARKER, "Optimum environment")
    python = root / "bin" / "python3"
    if not python.exists():
        raise _missing("Optimum environment", root, "its Python is gone")
    return OptimumEnv(root, python, dict(info.get("packages", {})))


def find_transformersjs(root: Path | None = None) -> TransformersJs:
    """transformers.js at ``root`` (default :func:`transformersjs_path`), or a one-line
    TfgraphError naming the command that installs it."""
    root = Path(root) if root is not None else transformersjs_path()
    info = _marker(root, TRANSFORMERSJS_MARKER, "transformers.js")
    if not (root / "node_modules" / "@huggingface" / "transformers").is_dir():
        raise _missing("transformers.js", root, "node_modules/@huggingface/transformers is gone")
    return TransformersJs(root, _node(), dict(info.get("packages", {})))


def _run(cmd: list[str], what: str, cwd: Path | None = None) -> None:
    logger.info("+ %s", " ".join(cmd))
    code = subprocess.call(cmd, cwd=cwd)
    if code != 0:
        raise TfgraphError(f"{what} failed (exit {code}); its output is above")


def _fresh(root: Path, marker: str, force: bool, is_ours) -> None:
    """Make ``root`` ready to (re)install into: refuse a folder that is not ours, clear it
    under ``force``, drop the marker (incomplete until written again)."""
    if root.resolve() == Path(sys.prefix).resolve():
        raise TfgraphError(f"{root} is the environment tfgraph runs in: choose another path")
    if root.exists() and not is_ours(root) and any(root.iterdir()):
        raise TfgraphError(f"{root} exists and is not an install of this tool: remove it first")
    if root.exists() and force:
        shutil.rmtree(root)
    if root.exists():
        (root / marker).unlink(missing_ok=True)


_PROBE = """\
import json, sys
from importlib import metadata
import optimum.onnxruntime  # the client itself imports
print(json.dumps({n: metadata.version(n) for n in sys.argv[1:]}))
"""


def install_optimum(root: Path | None = None, *, force: bool = False) -> OptimumEnv:
    """Create (or bring up to date) the Optimum environment at ``root``; return it. Does
    nothing when its marker says it holds these requirements. Needs ``pip`` to reach a
    package index."""
    root = Path(root) if root is not None else optimum_path()
    wanted = optimum_requirements()
    if not force:
        try:
            env = find_optimum(root)
        except TfgraphError:
            pass
        else:
            if json.loads((root / OPTIMUM_MARKER).read_text()).get("requirements") == wanted:
                logger.info("Optimum environment at %s is up to date", root)
                return env
    _fresh(root, OPTIMUM_MARKER, force, lambda r: (r / "pyvenv.cfg").is_file())
    if not (root / "pyvenv.cfg").is_file():
        _run([sys.executable, "-m", "venv", str(root)], "creating the virtual environment")
    python = str(root / "bin" / "python3")
    pip = [python, "-m", "pip", "install", "--disable-pip-version-check", "--quiet"]
    _run([*pip, *wanted], "installing Optimum")
    probe = subprocess.run(
        [python, "-c", _PROBE, *_PROBED], capture_output=True, text=True, check=False
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise TfgraphError(f"the new Optimum environment does not run: {last}")
    info = {"format": FORMAT, "requirements": wanted, "packages": json.loads(probe.stdout)}
    (root / OPTIMUM_MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return find_optimum(root)


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        raise TfgraphError(f"transformers.js needs node >= {NODE_MAJOR} on PATH: install it")
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=False)
    match = re.match(r"v(\d+)\.", out.stdout.strip())
    if not match or int(match.group(1)) < NODE_MAJOR:
        raise TfgraphError(
            f"transformers.js needs node >= {NODE_MAJOR}, this is {out.stdout.strip() or '?'}"
        )
    return node


_NODE_ARCH = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}


def _ort_binding(root: Path) -> Path:
    """onnxruntime-node's native binding for this machine, as its package ships it."""
    arch = _NODE_ARCH.get(platform.machine().lower(), platform.machine().lower())
    bin_dir = root / "node_modules" / "onnxruntime-node" / "bin"
    found = sorted(bin_dir.glob(f"napi-v*/{sys.platform}/{arch}/onnxruntime_binding.node"))
    if not found:
        raise TfgraphError(
            f"onnxruntime-node ships no binding for {sys.platform}/{arch} under {bin_dir}: "
            "transformers.js cannot run ONNX models on this machine"
        )
    return found[-1]


_NODE_PROBE = (
    "const t = await import('@huggingface/transformers');"
    "const o = await import('onnxruntime-node');"
    "console.log(JSON.stringify({'@huggingface/transformers': t.env.version,"
    " 'onnxruntime-node': o.env.versions.node}));"
)


def install_transformersjs(root: Path | None = None, *, force: bool = False) -> TransformersJs:
    """Install transformers.js into ``root`` (``npm install --ignore-scripts``); return it.
    Does nothing when its marker says it holds this version. Needs ``npm`` to reach its
    registry."""
    root = Path(root) if root is not None else transformersjs_path()
    node = _node()
    if not force:
        try:
            found = find_transformersjs(root)
        except TfgraphError:
            pass
        else:
            marker = json.loads((root / TRANSFORMERSJS_MARKER).read_text())
            if marker.get("requirements") == [TRANSFORMERSJS]:
                logger.info("transformers.js at %s is up to date", root)
                return found
    _fresh(root, TRANSFORMERSJS_MARKER, force, lambda r: (r / "package.json").is_file())
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "package.json").is_file():
        package = {"name": "tfgraph-transformersjs", "private": True, "type": "module"}
        (root / "package.json").write_text(json.dumps(package, indent=2) + "\n")
    npm = shutil.which("npm")
    if npm is None:
        raise TfgraphError("transformers.js is installed with npm: put npm on PATH")
    # --ignore-scripts: onnxruntime-node's postinstall downloads GPU providers from outside
    # the registry; the CPU binding is in the package (checked below)
    flags = ["--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"]
    _run([npm, "install", *flags, TRANSFORMERSJS], "npm install of transformers.js", cwd=root)
    _ort_binding(root)
    probe = subprocess.run(
        [node, "--input-type=module", "-e", _NODE_PROBE],
        capture_output=True, text=True, check=False, cwd=root,
    )  # fmt: skip
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise TfgraphError(f"transformers.js does not load in node: {last}")
    info = {
        "format": FORMAT,
        "requirements": [TRANSFORMERSJS],
        "packages": json.loads(probe.stdout),
    }
    (root / TRANSFORMERSJS_MARKER).write_text(json.dumps(info, indent=2) + "\n")
    return find_transformersjs(root)


CLIENTS = ("optimum", "transformersjs")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog=f"{INSTALL_COMMAND}",
        description="Install the clients of --flavour optimum apart from tfgraph: Optimum "
        "(a virtual environment of its own) and transformers.js (node).",
    )
    parser.add_argument("--only", choices=CLIENTS, help="one of them (default: both)")
    parser.add_argument("--force", action="store_true", help="reinstall from scratch")
    parser.add_argument("--check", action="store_true", help="only say whether installed")
    args = parser.parse_args(argv)
    # the command shows the library's progress (each pip/npm step) on stderr
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    chosen = [args.only] if args.only else list(CLIENTS)
    try:
        for client in chosen:
            if client == "optimum":
                found = find_optimum() if args.check else install_optimum(force=args.force)
                name = "Optimum environment"
            else:
                found = (
                    find_transformersjs()
                    if args.check
                    else install_transformersjs(force=args.force)
                )
                name = "transformers.js"
            held = ", ".join(f"{k} {v}" for k, v in found.packages.items())
            print(f"{name}: {found.root} ({held})")
    except TfgraphError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
