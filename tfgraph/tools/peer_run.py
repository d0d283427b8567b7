"""Greedy generation by the clients of an ``optimum``-flavour artifact, each in its own
environment (:mod:`tfgraph.tools.peer_clients`): Optimum's ``ORTModelForCausalLM.generate``
(``ORTModelForSeq2SeqLM`` for an encoder-decoder, as ``config.json`` says) and transformers.js's
``pipeline("text-generation" | "text2text-generation", …).model.generate`` in node.

Both get the same left-padded batch (prompts right-aligned, ``attention_mask`` 0 on the pads)
and return each row's new tokens only (an encoder-decoder's after its decoder start token), as
lists of ids: what tfgraph's own ``generate`` returns for the same prompts. A row that meets
``eos_token_id`` stops there (the EOS kept; the clients pad the rest, which is dropped). Each
call starts a fresh process (seconds).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from pathlib import Path

from tfgraph.errors import TfgraphError, first_line
from tfgraph.tools.peer_clients import find_optimum, find_transformersjs

_OPTIMUM = """\
import json, sys
import torch
from optimum.onnxruntime import ORTModelForCausalLM, ORTModelForSeq2SeqLM

job = json.load(sys.stdin)
cls = ORTModelForSeq2SeqLM if job["seq2seq"] else ORTModelForCausalLM
model = cls.from_pretrained(job["artifact"])
ids = torch.tensor(job["ids"], dtype=torch.long)
out = model.generate(
    input_ids=ids,
    attention_mask=torch.tensor(job["mask"], dtype=torch.long),
    max_new_tokens=job["max_new_tokens"],
    do_sample=False,
    num_beams=1,
    eos_token_id=job["eos"],
    pad_token_id=job["pad"],
)
start = 1 if job["seq2seq"] else ids.shape[1]  # after the decoder's start token, the prompt
print(json.dumps(out[:, start:].tolist()))
"""

_TRANSFORMERSJS = """\
import { env, pipeline, Tensor } from '@huggingface/transformers';
import { basename, dirname } from 'node:path';
const job = JSON.parse(process.argv[1]);
env.allowRemoteModels = false;  // local files only
env.localModelPath = dirname(job.artifact);
const task = job.seq2seq ? 'text2text-generation' : 'text-generation';
const generator = await pipeline(task, basename(job.artifact), { dtype: 'fp32' });
const tensor = (rows) => new Tensor('int64', BigInt64Array.from(rows.flat().map(BigInt)),
                                    [rows.length, rows[0].length]);
const out = await generator.model.generate({
    inputs: tensor(job.ids), attention_mask: tensor(job.mask),
    max_new_tokens: job.max_new_tokens, do_sample: false,
    eos_token_id: job.eos, pad_token_id: job.pad,
});
const start = job.seq2seq ? 1 : job.ids[0].length;  // after the start token, the prompt
console.log(JSON.stringify(out.tolist().map((row) => row.slice(start).map(Number))));
"""


def left_padded(prompts: Sequence[Sequence[int]], pad: int) -> tuple[list, list]:
    """(ids, mask): every prompt right-aligned, mask 0 on the padding."""
    width = max(len(p) for p in prompts)
    ids = [[pad] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return ids, mask


def until_eos(rows: Sequence[Sequence[int]], eos: int | None) -> list[list[int]]:
    """Each row up to and including its first ``eos`` (all of it without one)."""
    out = []
    for row in rows:
        row = [int(t) for t in row]
        out.append(row[: row.index(eos) + 1] if eos is not None and eos in row else row)
    return out


def _job(artifact, prompts, max_new_tokens, eos, pad) -> dict:
    ids, mask = left_padded(prompts, pad)
    config = Path(artifact) / "config.json"
    seq2seq = bool(json.loads(config.read_text()).get("is_encoder_decoder"))
    return {
        "seq2seq": seq2seq,
        "artifact": str(Path(artifact).resolve()),
        "ids": ids,
        "mask": mask,
        "max_new_tokens": max_new_tokens,
        "eos": eos,
        "pad": pad,
    }


def _tokens(cmd: list[str], what: str, *, cwd=None, stdin=None, timeout=600) -> list:
    done = subprocess.run(
        cmd, input=stdin, capture_output=True, text=True, cwd=cwd, timeout=timeout, check=False
    )
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or ["no output"]
        raise TfgraphError(f"{what} failed: {first_line(lines[-1])}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def optimum_generate(
    artifact: str | Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    env_root: Path | None = None,
) -> list[list[int]]:
    """Optimum's greedy tokens for ``prompts`` (new tokens per row, cut at EOS)."""
    env = find_optimum(env_root)
    job = _job(artifact, prompts, max_new_tokens, eos_token_id, pad_token_id)
    rows = _tokens([str(env.python), "-c", _OPTIMUM], "Optimum's generate", stdin=json.dumps(job))
    return until_eos(rows, eos_token_id)


def transformersjs_generate(
    artifact: str | Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    root: Path | None = None,
) -> list[list[int]]:
    """transformers.js's greedy tokens for ``prompts`` in node (new tokens per row, cut at
    EOS)."""
    found = find_transformersjs(root)
    job = _job(artifact, prompts, max_new_tokens, eos_token_id, pad_token_id)
    rows = _tokens(
        [found.node, "--input-type=module", "-e", _TRANSFORMERSJS, json.dumps(job)],
        "transformers.js's generate",
        cwd=found.root,  # where '@huggingface/transformers' resolves
    )
    return until_eos(rows, eos_token_id)
