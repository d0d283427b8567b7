"""Train the reference decoder: a small Llama-style model with its own tokenizer, on text every
machine has without a download (the Python standard library's own sources), seeded.

Why: every other tfgraph model has random weights, so "int4 passes parity" proves only that the
graph computes what the dequantized eager model computes. A trained model has real logit margins
and real weight outliers, so the cost of a quantization method (perplexity, KL divergence, top-1
agreement against fp32) means something (issue 48).

    python -m tfgraph.tools.train_reference OUT [--steps N] [--seed S]
    python -m tfgraph.tools.train_reference OUT --tokenizer bench/reference_model --layers 2 \
        --hidden 256 --heads 4 --kv-heads 2 --intermediate 640   # a draft model (issue 49)
    ... --distill-from bench/reference_model   # the draft trained on the target's distributions

``--distill-from DIR`` trains against the model in ``DIR`` instead of the text's next tokens:
the loss is the KL divergence from that model's next-token distribution (its tokenizer is
reused), as speculative drafts are trained (DistillSpec, Zhou et al. 2023), so the draft
agrees with its target more often; figures then include the top-1 agreement with it on the
held-out text.

writes ``OUT/`` as a Hugging Face directory (``config.json``, ``model.safetensors`` in bf16, the
tokenizer), ``OUT/heldout.txt``, text from files the model never trained on, and
``OUT/figures.json``, its held-out perplexity and how it was trained. The corpus is
the standard library's ``.py`` files in sorted order, every :data:`HELDOUT_EVERY`-th file held
out; tests and packages' own test suites are left out (they repeat the code they test).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HELDOUT_EVERY = 20  # every 20th file (sorted) is held out
HELDOUT_CHARS = 60_000  # the held-out text: enough for a perplexity to 1e-3 relative
SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "__pycache__"}


@dataclass(frozen=True)
class Plan:
    """What is trained: the model's shape, the corpus size and the optimisation. The defaults
    fit 30 minutes on 2 cores and a bf16 checkpoint under 40 MB (about 19 M parameters)."""

    vocab: int = 6144
    hidden: int = 512
    layers: int = 6
    heads: int = 8
    kv_heads: int = 2
    intermediate: int = 1280
    context: int = 256
    batch: int = 12
    steps: int = 500
    lr: float = 1.5e-3
    warmup: int = 40
    corpus_chars: int = 6_000_000
    seed: int = 0
    tokenizer: str | None = None  # a directory whose tokenizer is reused (a draft's target)
    teacher: str | None = None  # a directory whose model's distributions are the targets


def corpus_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library at ``root``."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = sorted(
        p for p in root.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(root).parts[:-1])
    )
    held = set(files[::HELDOUT_EVERY])
    return [f for f in files if f not in held], sorted(held)


def read_text(files: list[Path], limit: int) -> str:
    """The files' text joined, up to ``limit`` characters (whole files only)."""
    parts, total = [], 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if total + len(text) > limit:
            break
        parts.append(text)
        total += len(text)
    return "\n".join(parts)


def train_tokenizer(text: str, vocab: int):
    """A byte-level BPE tokenizer trained on ``text`` (the ``tokenizers`` library), wrapped as
    a transformers fast tokenizer with BOS/EOS."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def load_tokenizer(directory: str):
    """The fast tokenizer saved in ``directory`` (a speculative draft must share its target's
    tokenizer, so it is reused rather than retrained)."""
    import transformers

    return transformers.PreTrainedTokenizerFast.from_pretrained(directory)


def build_model(plan: Plan, tokenizer):
    """The Llama-shaped model of ``plan``, tied embeddings, random init under the plan's seed."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=plan.hidden,
        intermediate_size=plan.intermediate,
        num_hidden_layers=plan.layers,
        num_attention_heads=plan.heads,
        num_key_value_heads=plan.kv_heads,
        max_position_embeddings=plan.context * 4,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(plan.seed)
    return transformers.LlamaForCausalLM(config)


def _lr(plan: Plan, step: int) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < plan.warmup:
        return plan.lr * (step + 1) / plan.warmup
    progress = (step - plan.warmup) / max(plan.steps - plan.warmup, 1)
    return plan.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _distilled(model, teacher, batch: torch.Tensor) -> torch.Tensor:
    """KL(teacher || model) of the next-token distributions, averaged over positions."""
    with torch.no_grad():
        target = torch.log_softmax(teacher(input_ids=batch).logits.float(), -1)
    logits = torch.log_softmax(model(input_ids=batch).logits.float(), -1)
    kl = torch.nn.functional.kl_div(logits, target, log_target=True, reduction="none")
    return kl.sum(-1).mean()


def train(model, ids: torch.Tensor, plan: Plan, progress=None, teacher=None) -> list[float]:
    """``plan.steps`` AdamW steps on random windows of ``ids`` (seeded); the losses. With
    ``teacher``: the KL divergence from its distributions instead of the next tokens."""
    generator = torch.Generator().manual_seed(plan.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.lr, weight_decay=0.1)
    model.train()
    losses, start = [], time.monotonic()
    for step in range(plan.steps):
        starts = torch.randint(0, len(ids) - plan.context, (plan.batch,), generator=generator)
        batch = torch.stack([ids[s : s + plan.context] for s in starts.tolist()])
        for group in optimizer.param_groups:
            group["lr"] = _lr(plan, step)
        if teacher is None:
            loss = model(input_ids=batch, labels=batch).loss  # transformers shifts the labels
        else:
            loss = _distilled(model, teacher, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
        if progress is not None and (step % 20 == 0 or step == plan.steps - 1):
            progress(step + 1, plan.steps, losses[-1], time.monotonic() - start)
    model.eval()
    return losses


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, context: int) -> float:
    """The model's perplexity over ``ids`` in consecutive windows of ``context`` tokens (each
    window's first token unscored: no overlap, so every scored token is scored once)."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, context):
        window = ids[start : start + context + 1][None]
        if window.shape[1] < 2:
            break
        logits = model(input_ids=window[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum")
        total, count = total + float(loss), count + window.shape[1] - 1
    return math.exp(total / count)


@torch.no_grad()
def agreement(model, teacher, ids: torch.Tensor, context: int) -> float:
    """The share of positions of ``ids`` (windows of ``context``) where the two models' most
    likely next tokens are the same: what greedy speculative decoding accepts."""
    same, count = 0, 0
    for start in range(0, len(ids) - 1, context):
        window = ids[start : start + context][None]
        a = model(input_ids=window).logits.argmax(-1)
        b = teacher(input_ids=window).logits.argmax(-1)
        same, count = same + int((a == b).sum()), count + window.shape[1]
    return same / count


def make_reference(out: Path, plan: Plan, root: Path | None = None, progress=None) -> dict:
    """Train and write the reference directory (module doc); its figures."""
    out = Path(out)
    train_files, held_files = corpus_files(root)
    text = read_text(train_files, plan.corpus_chars)
    heldout = read_text(held_files, HELDOUT_CHARS)
    teacher = None
    if plan.teacher:
        import transformers

        teacher = transformers.AutoModelForCausalLM.from_pretrained(plan.teacher).float().eval()
    if plan.tokenizer or plan.teacher:
        tokenizer = load_tokenizer(plan.tokenizer or plan.teacher)
    else:
        tokenizer = train_tokenizer(text, plan.vocab)
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    model = build_model(plan, tokenizer)
    start = time.monotonic()
    losses = train(model, ids, plan, progress, teacher)
    seconds = time.monotonic() - start
    held_ids = torch.tensor(tokenizer(heldout)["input_ids"], dtype=torch.long)
    before = perplexity(model, held_ids, plan.context)
    model.to(torch.bfloat16)  # what is committed; its figure is measured with those weights
    figures = {
        "heldout_ppl": perplexity(model.float(), held_ids, plan.context),
        "about": "perplexity of the bf16 checkpoint (weights upcast to fp32) on heldout.txt, "
        "windows of `context` tokens; python -m tfgraph.tools.train_reference",
        "context": plan.context,
        "steps": plan.steps,
        "batch": plan.batch,
        "seed": plan.seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": len(ids),
        "heldout_tokens": len(held_ids),
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "heldout_ppl_before_bf16": before,
        "train_seconds": round(seconds, 1),
    }
    if teacher is not None:
        figures["distilled_from"] = str(plan.teacher)
        figures["top1_agreement_with_teacher"] = agreement(
            model.float(), teacher, held_ids, plan.context
        )
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "heldout.txt").write_text(heldout, encoding="utf-8")
    (out / "figures.json").write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
    return figures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=Plan.steps)
    parser.add_argument("--seed", type=int, default=Plan.seed)
    parser.add_argument("--tokenizer", default=None, help="reuse this directory's tokenizer")
    parser.add_argument(
        "--distill-from", default=None, metavar="DIR",
        help="train on this model's next-token distributions (a speculative draft's target)",
    )  # fmt: skip
    for name in ("layers", "hidden", "heads", "kv_heads", "intermediate"):
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=int, default=getattr(Plan, name))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    def progress(step, steps, loss, seconds):
        eta = seconds / step * (steps - step)
        logger.info("step %d/%d  loss %.3f  %.0f s, %.0f s left", step, steps, loss, seconds, eta)

    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "intermediate")}
    plan = Plan(
        steps=args.steps, seed=args.seed, tokenizer=args.tokenizer, teacher=args.distill_from,
        **shape,
    )  # fmt: skip
    figures = make_reference(args.out, plan, progress=progress)
    for key, value in figures.items():
        logger.info("%s: %s", key, value)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
