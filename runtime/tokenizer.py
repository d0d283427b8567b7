"""An artifact's tokenizer (``tokenizer/``, copied at export from a Hugging Face directory)."""

from __future__ import annotations

from pathlib import Path

from tfgraph.errors import TfgraphError, first_line


def load_tokenizer(path: str | Path):
    """The tokenizer an artifact carries (``path``: the artifact or a file in it), loaded
    offline and without running code it names; a one-line error when there is none."""
    directory = Path(path)
    directory = directory if directory.is_dir() else directory.parent
    if not (directory / "tokenizer").is_dir():
        raise TfgraphError(
            f"'{directory}' carries no tokenizer (export from a Hugging Face directory that has "
            "one); use --input-ids"
        )
    try:
        import transformers
    except ImportError as exc:
        raise TfgraphError("--text needs transformers: pip install 'tfgraph[hf]'") from exc
    try:  # tokenizer files are data: code they name (auto_map) is never run
        return transformers.AutoTokenizer.from_pretrained(
            directory / "tokenizer", local_files_only=True, trust_remote_code=False
        )
    except Exception as exc:
        first = first_line(exc)
        raise TfgraphError(
            f"cannot load the tokenizer in '{directory / 'tokenizer'}' ({first}); use --input-ids"
        ) from exc
