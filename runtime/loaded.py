"""``tfgraph.load(dir)``: an artifact ready to generate from Python (a notebook, a script).

::

    model = tfgraph.load("out")
    model.generate("w1 w2 w3", max_new_tokens=8)   # → the new text
    model.generate([1, 5, 9], max_new_tokens=8)    # → the new token ids

:class:`LoadedModel` puts the pieces the CLI's ``generate`` joins behind one object: the
runner the artifact's target names (:func:`open_runner`), the :class:`CachedDecoder` and
:func:`generate` over it, the artifact's tokenizer (:mod:`.tokenizer`) and its manifest. What
goes in comes out: text in → text out (the new tokens decoded, special tokens skipped), token
ids in → token ids out; a list of either is a batch (left-padded). Decoding stops at the
tokenizer's end-of-sequence token unless ``ignore_eos``.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path

from tfgraph.errors import TfgraphError
from tfgraph.exporters.manifest import read_manifest
from tfgraph.runtime.drafters import DraftModel, PromptLookup
from tfgraph.runtime.generate import CachedDecoder, GenerationConfig, generate, seq2seq_prompts
from tfgraph.runtime.runner import Runner, open_runner
from tfgraph.runtime.speculative import DraftLength, SpeculativeStats
from tfgraph.runtime.speculative_loop import speculative_generate
from tfgraph.runtime.tokenizer import load_tokenizer
from tfgraph.runtime.vision_language import ImagePrompts, vision_language

logger = logging.getLogger(__name__)


def load(
    path: str | Path, *, provider: str | Sequence[str] = "cpu", spinning: bool = True
) -> LoadedModel:
    """The artifact in ``path`` (exported with ``kv_cache=True`` to generate), opened with the
    runner its target names; ``provider``: ``cpu`` (default) or ``cuda`` (ONNX Runtime).
    ``spinning=False``: its session's threads sleep between runs (give it for a model that
    will decode with a ``draft``: the two sessions take turns on the same cores)."""
    return LoadedModel(path, provider=provider, spinning=spinning)


class LoadedModel:
    """An opened artifact: :meth:`generate`, its :attr:`tokenizer` (``None`` when it carries
    none), its :attr:`manifest` and the :attr:`runner` it runs on."""

    def __init__(
        self, path: str | Path, *, provider: str | Sequence[str] = "cpu", spinning: bool = True
    ) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise TfgraphError(f"no artifact directory at '{self.path}': give an export's output")
        self.manifest: dict = read_manifest(self.path) or {}
        providers = [provider] if isinstance(provider, str) else list(provider)
        self.runner: Runner = open_runner(self.path, providers=providers, spinning=spinning)
        self._spinning = spinning
        self._providers, self._images = providers, None  # a vision-language artifact's prompts
        self.tokenizer = load_tokenizer(self.path) if (self.path / "tokenizer").is_dir() else None
        self._decoder: CachedDecoder | None = None
        self.speculative_stats = None  # the last speculative generate's counters

    def __repr__(self) -> str:
        origin = self.manifest.get("model", "?")
        tokenizer = "a tokenizer" if self.tokenizer is not None else "no tokenizer"
        return f"<tfgraph.LoadedModel {str(self.path)!r}: {origin}, {tokenizer}>"

    @property
    def decoder(self) -> CachedDecoder:
        """The KV-cached decoder over :attr:`runner` (a one-line error for an artifact exported
        without ``kv_cache``)."""
        if self._decoder is None:
            self._decoder = CachedDecoder(self.runner)
        return self._decoder

    def generate(
        self,
        prompt,
        max_new_tokens: int = 32,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        eos_token_id: int | None = None,
        ignore_eos: bool = False,
        pad_token_id: int | None = None,
        decoder_start_token_id: int = 0,
        image=None,
        draft=None,
        prompt_lookup: int | None = None,
        speculative_k: int = 4,
        adaptive_k: bool = False,
    ):
        """Generate after ``prompt``: a text (→ the new text), token ids (→ the new ids; a
        list, an array, a tensor or the tokenizer's output), or a list of either (a batch → a
        list). Greedy unless ``do_sample`` (with ``temperature``, ``top_k``, ``top_p``,
        ``seed``). Stops after ``max_new_tokens`` or at ``eos_token_id`` (default: the
        tokenizer's; ``ignore_eos``: never). Padding uses ``pad_token_id`` (default: the
        tokenizer's, else its EOS, else 0); an encoder-decoder's decoder starts from
        ``decoder_start_token_id``. ``image``: a vision-language artifact's image (a PIL image
        or a file; one per text of a batch), through the model's own processor.

        Speculative decoding (one prompt, docs/speculative.md): ``draft`` (a smaller artifact's
        directory or :class:`LoadedModel` with the same tokenizer) or ``prompt_lookup`` (the
        n-gram length looked up in the prompt + output) drafts ``speculative_k`` tokens that
        one step verifies (``adaptive_k``: k adapted); the same greedy tokens, sampled ones
        distributed alike. Its counters are left in :attr:`speculative_stats`."""
        texts, prompts, single = self._prompts(prompt)
        config = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_token_id=None if ignore_eos else self._special("eos", eos_token_id),
            pad_token_id=self._special("pad", pad_token_id) or 0,
        )
        decoder, extra = self.decoder, None
        if vision_language(self.manifest) is not None or image is not None:
            prompts, extra = self._image_prompts(prompt, prompts, texts, image)
        elif decoder.seq2seq:  # the prompts feed the encoder; the decoder starts afresh
            prompts, extra = seq2seq_prompts(
                decoder, prompts, config.pad_token_id, decoder_start_token_id
            )
        if draft is not None or prompt_lookup is not None:
            tokens = self._speculative(
                prompts,
                config,
                extra,
                draft,
                prompt_lookup,
                DraftLength(k=speculative_k, adaptive=adaptive_k),
            )
        else:
            tokens = generate(decoder, prompts, config, extra=extra).tokens
        if texts:
            out = [self.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
        else:
            out = tokens
        return out[0] if single else out

    def _speculative(self, prompts, config, extra, draft, lookup, length) -> list[list[int]]:
        """One prompt through :func:`speculative_generate` (a draft model or prompt lookup)."""
        if draft is not None and lookup is not None:
            raise TfgraphError("give draft= or prompt_lookup=, not both")
        if len(prompts) != 1 or extra:
            raise TfgraphError("speculative decoding takes one text or token-id prompt")
        if lookup is not None:
            drafter = PromptLookup(max_ngram=lookup)
        else:
            if self._spinning:
                logger.warning(
                    "the model's session spin-waits between steps, slowing its draft's on "
                    "the same cores: open it with tfgraph.load(..., spinning=False)"
                )
            model = draft if isinstance(draft, LoadedModel) else LoadedModel(draft, spinning=False)
            drafter = DraftModel(model.decoder, self.decoder, seed=config.seed)
        self.speculative_stats = SpeculativeStats()
        tokens = speculative_generate(
            self.decoder, prompts[0], drafter, config, length=length, stats=self.speculative_stats
        )
        return [tokens]

    def _image_prompts(self, prompt, ids: list, texts: bool, image) -> tuple[list, dict]:
        """A vision-language artifact's prompts: texts through its processor (with ``image``),
        token ids as they are (without an image); and the decoder's image features."""
        if self._images is None:
            self._images = ImagePrompts(self.path, providers=self._providers)
        if not texts:
            if image is not None:
                raise TfgraphError("an image goes with a text prompt (the processor places it)")
            return ids, self._images.without_image(len(ids))
        batch = [prompt] if isinstance(prompt, str) else list(prompt)
        images = None if image is None else image if isinstance(image, (list, tuple)) else [image]
        return self._images.prepare(batch, images)

    def _prompts(self, prompt) -> tuple[bool, list[list[int]], bool]:
        """(whether the prompts are texts, their token ids, whether there was one prompt)."""
        if isinstance(prompt, Mapping) and "input_ids" in prompt:  # the tokenizer's output
            prompt = prompt["input_ids"]
        if hasattr(prompt, "tolist"):  # a numpy array or a tensor of ids
            prompt = prompt.tolist()
        single = isinstance(prompt, str) or _ids(prompt)
        batch = [prompt] if single else list(prompt) if isinstance(prompt, (list, tuple)) else []
        if batch and all(isinstance(p, str) for p in batch):
            if self.tokenizer is None:
                raise TfgraphError(
                    f"'{self.path}' carries no tokenizer: give token ids, or export with "
                    "tokenizer=… (or from a Hugging Face directory that has one)"
                )
            return True, [self.tokenizer(p)["input_ids"] for p in batch], single
        batch = [p.tolist() if hasattr(p, "tolist") else p for p in batch]
        if not batch or not all(_ids(p) for p in batch):
            raise TfgraphError(
                "prompt: a text, a list of token ids, or a list of either (a batch); got "
                f"{type(prompt).__name__}"
            )
        return False, [[int(t) for t in p] for p in batch], single

    def _special(self, kind: str, given: int | None) -> int | None:
        """``given``, else the tokenizer's ``eos``/``pad`` token id (pad: its eos if no pad)."""
        if given is not None or self.tokenizer is None:
            return given
        found = getattr(self.tokenizer, f"{kind}_token_id", None)
        if found is None and kind == "pad":
            found = getattr(self.tokenizer, "eos_token_id", None)
        return found


def _ids(prompt) -> bool:
    """A non-empty list of token ids (ints)."""
    return (
        isinstance(prompt, (list, tuple))
        and len(prompt) > 0
        and all(isinstance(t, numbers.Integral) for t in prompt)
    )
