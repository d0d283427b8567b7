"""Kubernetes manifests of the docs checked against KServe's schema, without a cluster.

    python -m tfgraph.runtime.serving.kserve_check --install          # the environment
    python -m tfgraph.runtime.serving.kserve_check docs/serving.md   # every ```yaml block

What checks them: the ``kserve`` SDK's OpenAPI-generated models (``V1beta1InferenceService``
and every model under it, with their client-side validation) and the ``kubernetes`` client's
models (``V1Deployment``, ``V1Service``, ``V1Container``…: pydantic, unknown keys forbidden),
walked by :mod:`.kserve_probe`. Nothing of KServe is copied here: the SDK is installed from
the package index into an environment of its own, like the Triton server's (:mod:`.install`),
because ``import kserve`` pulls in its model server (FastAPI, gRPC, pandas: ~450 MB) that
tfgraph's environment has no use for.

Layout: a venv at ``$TFGRAPH_KSERVE_ENV``, by default ``<sys.prefix>/tfgraph-kserve`` (inside the
environment tfgraph runs in, removed with it), holding ``KSERVE`` and PyYAML, and
``tfgraph-kserve.json``, written last: what was installed.
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
from pathlib import Path

from tfgraph.errors import TfgraphError

logger = logging.getLogger(__name__)

INSTALL_COMMAND = "python -m tfgraph.runtime.serving.kserve_check --install"
ENV_VAR = "TFGRAPH_KSERVE_ENV"
MARKER = "tfgraph-kserve.json"
KSERVE = "kserve==0.21.0"  # its models: KServe's v1beta1 API of that release
REQUIREMENTS = (KSERVE, "pyyaml")
PROBE = Path(__file__).with_name("kserve_probe.py")


def default_path() -> Path:
    """``$TFGRAPH_KSERVE_ENV``, else ``<sys.prefix>/tfgraph-kserve``."""
    given = os.environ.get(ENV_VAR)
    return Path(given).expanduser() if given else Path(sys.prefix) / "tfgraph-kserve"


def find_kserve_env(root: Path | None = None) -> Path:
    """The Python of the KServe environment at ``root``, or a one-line error naming the
    command that installs it."""
    root = Path(root) if root is not None else default_path()
    python = root / "bin" / "python3"
    try:
        info = json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        info = None
    if info is None or info.get("requirements") != list(REQUIREMENTS) or not python.exists():
        why = "not installed" if not root.exists() else "incomplete or another version"
        raise TfgraphError(
            f"no KServe environment at {root} ({why}): install it with `{INSTALL_COMMAND}`"
        )
    return python


def install_kserve_env(root: Path | None = None, *, force: bool = False) -> Path:
    """Create (or bring up to date) the KServe environment at ``root``; its Python."""
    root = Path(root) if root is not None else default_path()
    if not force:
        try:
            return find_kserve_env(root)
        except TfgraphError:
            pass
    if root.resolve() == Path(sys.prefix).resolve():
        raise TfgraphError(f"{root} is the environment tfgraph runs in: choose another path")
    if root.exists() and not (root / "pyvenv.cfg").is_file():
        raise TfgraphError(f"{root} exists and is not a virtual environment: remove it first")
    if root.exists() and force:
        shutil.rmtree(root)
    (root / MARKER).unlink(missing_ok=True)  # incomplete until written again
    if not (root / "pyvenv.cfg").is_file():
        _run([sys.executable, "-m", "venv", str(root)], "creating the virtual environment")
    python = root / "bin" / "python3"
    _run([str(python), "-m", "pip", "install", "--disable-pip-version-check", "--quiet",
          *REQUIREMENTS], "installing kserve")  # fmt: skip
    (root / MARKER).write_text(json.dumps({"requirements": list(REQUIREMENTS)}) + "\n")
    return find_kserve_env(root)


def _run(cmd: list[str], what: str) -> None:
    logger.info("+ %s", " ".join(cmd))
    if subprocess.call(cmd) != 0:
        raise TfgraphError(f"{what} failed; pip's output is above")


def check_manifests(manifests: list, root: Path | None = None) -> list[list[str]]:
    """Each manifest's problems (a mapping or YAML text; an empty list: it passed)."""
    python = find_kserve_env(root)
    done = subprocess.run(
        [str(python), str(PROBE)], input=json.dumps(manifests), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise TfgraphError(f"the KServe check did not run: {last}")
    return json.loads(done.stdout)


def yaml_blocks(markdown: str) -> list[str]:
    """The ```yaml fenced blocks of a Markdown text that hold a ``kind:``."""
    blocks = re.findall(r"^```ya?ml\n(.*?)^```", markdown, flags=re.S | re.M)
    return [b for b in blocks if re.search(r"^kind:", b, flags=re.M)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tfgraph.runtime.serving.kserve_check",
        description="Check the Kubernetes manifests (```yaml blocks) of Markdown files against "
        "KServe's and Kubernetes' schemas, in an environment of their own.",
    )
    parser.add_argument("files", nargs="*", type=Path, help="Markdown files (or YAML files)")
    parser.add_argument("--install", action="store_true", help="create the environment first")
    parser.add_argument("--path", type=Path, help=f"the environment (default: ${ENV_VAR})")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.install:
            print(f"KServe environment: {install_kserve_env(args.path).parent.parent}")
        texts = [(f, t) for f in args.files for t in _manifests_of(f)]
        results = check_manifests([t for _, t in texts], args.path) if texts else []
    except (TfgraphError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    bad = 0
    for (path, text), problems in zip(texts, results, strict=True):
        kind = re.search(r"^kind:\s*(\S+)", text, flags=re.M)
        name = f"{path}: {kind.group(1) if kind else 'manifest'}"
        print(f"{name}: {'ok' if not problems else '; '.join(problems)}")
        bad += bool(problems)
    return 1 if bad else 0


def _manifests_of(path: Path) -> list[str]:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        return [doc for doc in re.split(r"^---\s*$", text, flags=re.M) if doc.strip()]
    return yaml_blocks(text)


if __name__ == "__main__":
    sys.exit(main())
