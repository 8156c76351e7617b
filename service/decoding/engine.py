"""The decoding engine: a model repository on ONNX Runtime, greedy and beam search.

``Engine`` loads a repository (checksums verified), its tokenizers and the ONNX
Runtime sessions of one precision on one provider; ``prepare`` validates and
tokenizes a text; ``new_batch`` gives a running batch (``service.decoding.batch``) that
the scheduler drives step by step; ``translate`` does it all for a list of
texts. Search: ``service.decoding.search`` (fairseq-style beam search; greedy is beam 1;
finished hypotheses ranked by ``score / length ** length_penalty``, length
counting the EOS). Torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from service.decoding.batch import Batch, SpecialIds
from service.errors import ModelRepositoryError, invalid
from service.interface import Prepared, Translation
from service.models.manifest import Manifest, load_manifest
from service.options import DecodingOptions, Limits, validate_options, validate_text
from service.decoding.runtime import PROVIDERS, Runtime
from service.text.tokenizer import Tokenizer

PRECISIONS = ("fp32", "int8")


class Engine:
    """What the scheduler needs from a model: ``prepare`` and ``new_batch`` (``service.interface``)."""

    def __init__(self, manifest_or_path: Manifest | str | Path, *, precision: str = "fp32",
                 provider: str = "cpu", intra_op_threads: int | None = None,
                 limits: Limits = Limits(), decoder_spinning: bool = True) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {sorted(PROVIDERS)}, got {provider!r}")
        manifest = (manifest_or_path if isinstance(manifest_or_path, Manifest)
                    else load_manifest(Path(manifest_or_path)))
        self.manifest, self.limits, self.precision = manifest, limits, precision
        self.tokenizer = _tokenizer(manifest)
        self.special = _special_ids(manifest)
        self.vocab_size = int(manifest.model_config.get("tgt_vocab_size",
                                                        self.tokenizer.target.get_piece_size()))
        self.runtime = Runtime(manifest, precision=precision, provider=provider,
                               intra_op_threads=intra_op_threads, decoder_spinning=decoder_spinning)
        self.max_source_tokens = min(limits.max_source_tokens, manifest.max_source_tokens)

    def prepare(self, text: str, options: DecodingOptions, index: int) -> Prepared:
        """Validate options and text, tokenize with placeholder protection.

        Raises NmtError (INVALID_ARGUMENT) naming ``options.<field>`` or ``texts[index]``.
        """
        validate_options(options, self.limits)
        validate_text(text, index, self.limits)
        encoded = self.tokenizer.encode(text)
        if len(encoded.ids) > self.max_source_tokens:
            raise invalid(f"texts[{index}]", f"at most {self.max_source_tokens} source tokens "
                          "(the model's maximum input, EOS included)", len(encoded.ids))
        return Prepared(text=text, source_ids=tuple(encoded.ids), source_pieces=tuple(encoded.pieces),
                        placeholders=encoded.placeholders, options=options)

    def new_batch(self) -> Batch:
        """An empty running batch on this engine's sessions."""
        return Batch(self.runtime, self.tokenizer, special=self.special, vocab_size=self.vocab_size)

    def translate(self, texts: Sequence[str], options: DecodingOptions = DecodingOptions()
                  ) -> list[Translation]:
        """Translate ``texts`` in one batch; results in input order."""
        prepared = [self.prepare(text, options, i) for i, text in enumerate(texts)]
        batch = self.new_batch()
        batch.add(list(enumerate(prepared)))
        results: dict[int, Translation] = {}
        while batch.live_rows:
            results.update(batch.step())
        return [results[i] for i in range(len(texts))]


def _tokenizer(manifest: Manifest) -> Tokenizer:
    try:
        return Tokenizer(manifest.path(manifest.source_tokenizer), manifest.path(manifest.target_tokenizer))
    except ValueError as e:
        raise ModelRepositoryError(str(e)) from None


def _special_ids(manifest: Manifest) -> SpecialIds:
    try:
        return SpecialIds(**{k: int(manifest.special_ids[k]) for k in ("pad", "bos", "eos")})
    except (KeyError, TypeError, ValueError) as e:
        raise ModelRepositoryError(f"{manifest.root}: special_ids lacks or mangles {e}") from None
