"""``vlm_scale``: a vision-language checkpoint past 2B exported with ``--weights int4`` through
the streaming path, and its peak memory against the int4 artifact's size (issue 47: at most
the artifact's size + :data:`HEADROOM_GIB`).

The checkpoint is LLaVA-1.5-shaped, random, bf16: a CLIP ViT-L/14 tower at 336 px (577
positions, 24 layers, width 1024), LLaVA's two-layer projector, and a Llama-shaped text model
of :data:`TEXT` (2.2B parameters in all). It is written tensor by tensor
(:func:`tfgraph.tools.random_checkpoint.write_random_checkpoint`, never the whole model in
memory) with the family's own processor beside it (a generated word tokenizer holding the
image token: :func:`tfgraph.tools.tiny_processors.tiny_processor`). The export runs in its own
process as a user would run it, ``python -m tfgraph export DIR -o OUT --kv-cache --weights
int4``; its process tree's peak RSS is sampled every 0.2 s (:func:`tfgraph.bench.scale
.measured`).

    python -m tfgraph.bench.vlm_scale WORKDIR          # writes WORKDIR/llava-2b, exports it
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

GiB = 1024**3
HEADROOM_GIB = 3.0  # the acceptance: peak RSS ≤ the int4 artifact's size + this
# the text model: Llama-shaped, between TinyLlama 1.1B and Llama-2-7B (MHA, head dim 128)
TEXT = dict(
    hidden_size=2560, intermediate_size=6912, num_hidden_layers=22, num_attention_heads=20,
    num_key_value_heads=20, vocab_size=32064, max_position_embeddings=4096,
)  # fmt: skip
# CLIP ViT-L/14 at 336 px, as LLaVA-1.5 uses it
VISION = dict(
    hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
    image_size=336, patch_size=14, projection_dim=768,
)  # fmt: skip


def llava_config(text: dict | None = None, vision: dict | None = None):
    """A LLaVA-1.5 config with the given text and vision sizes (defaults: :data:`TEXT`,
    :data:`VISION`)."""
    import transformers

    config = transformers.LlavaConfig(
        text_config=transformers.LlamaConfig(**(text or TEXT)),
        vision_config=transformers.CLIPVisionConfig(**(vision or VISION)),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    config.architectures = ["LlavaForConditionalGeneration"]
    return config


def write_llava(directory: Path, config=None, dtype: str = "bf16") -> Path:
    """Write a random LLaVA checkpoint (``config``, default :func:`llava_config`) with its
    processor into ``directory``, one tensor at a time."""
    import transformers

    from tfgraph.tools.random_checkpoint import write_random_checkpoint
    from tfgraph.tools.tiny_processors import sync_token_ids, tiny_processor
    from tfgraph.tools.tiny_vlm_families import spec_for

    config = config or llava_config()
    processor = tiny_processor("llava", config, spec_for("llava"))
    sync_token_ids(config, processor)  # the config's image token is the tokenizer's
    cls = transformers.LlavaForConditionalGeneration
    write_random_checkpoint(config, directory, dtype=dtype, model_class=cls)
    processor.save_pretrained(directory)
    return Path(directory)


def parameters(directory: Path) -> int:
    from tfgraph.sources.checkpoint import Checkpoint

    total = 0
    for entry in Checkpoint(directory).entries.values():
        n = 1
        for d in entry.shape:
            n *= d
        total += n
    return total


def measure(checkpoint: Path, out: Path) -> dict:
    """Export ``checkpoint`` with int4 weights and a KV cache in a child process; its peak
    RSS, the artifact's size and whether peak ≤ artifact + :data:`HEADROOM_GIB`."""
    from tfgraph.bench.scale import measured

    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "tfgraph", "export", str(checkpoint), "-o", str(out),
           "--kv-cache", "--weights", "int4"]  # fmt: skip
    row = measured(cmd)
    row["parameters"] = parameters(checkpoint)
    row["checkpoint_gib"] = round(_bytes(checkpoint, "*.safetensors") / GiB, 2)
    if row["exit"] == 0 and (out / "report.json").is_file():
        report = json.loads((out / "report.json").read_text())
        row["artifact_gib"] = round(_bytes(out, "**/*") / GiB, 2)
        row["bound_gib"] = round(row["artifact_gib"] + HEADROOM_GIB, 2)
        row["within_bound"] = row["peak_rss_gib"] <= row["bound_gib"]
        row["parity"] = {
            name: bool(graph.get("passed")) for name, graph in report["parity"]["graphs"].items()
        }
        row["eager_reference"] = report["source"].get("eager_reference")
    return row


def _bytes(path: Path, pattern: str) -> int:
    return sum(f.stat().st_size for f in Path(path).glob(pattern) if f.is_file())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m tfgraph.bench.vlm_scale WORKDIR", file=sys.stderr)
        return 2
    work = Path(argv[0])
    checkpoint = work / "llava-2b"
    if not (checkpoint / "config.json").is_file():
        write_llava(checkpoint)
    row = measure(checkpoint, work / "llava-2b-int4")
    print(json.dumps({k: v for k, v in row.items() if k != "tail"}, indent=1))
    print("\n".join(row.get("tail", [])[-6:]), file=sys.stderr)
    return 0 if row.get("within_bound") else 1


if __name__ == "__main__":
    raise SystemExit(main())
