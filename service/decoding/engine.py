"""The decoding engine: a model repository on ONNX Runtime, greedy and beam search.

``Engine`` loads a repository (checksums verified), its tokenizers and the ONNX
Runtime sessions of one precision on one provider; ``prepare_text`` tokenizes a
text of a validated request; ``new_batch`` gives a running batch
(``service.decoding.batch``) that the scheduler drives step by step, in token
ids; ``translation`` and ``partial_text`` turn ids into text
(``service.text.render``); ``translate`` does it all for a list of texts.
Search: ``service.decoding.search``. Torch-free.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

from service.decoding.batch import Batch, Encoded, encode
from service.decoding.int8_form import FormChoice
from service.decoding.shortlist import ShortlistChoice, always_ids, load_shortlist
from service.decoding.shortlist import decide as decide_shortlist
from service.decoding.runtime import PROVIDERS, Runtime
from service.errors import ModelRepositoryError, invalid
from service.interface import Decoded, Key, Prepared, Translation
from service.models.manifest import Manifest, load_manifest
from service.options import DecodingOptions, Limits, validate_request
from service.text import render
from service.text.tokenizer import Tokenizer

PRECISIONS = ("fp32", "int8")


class Engine:
    """What the scheduler needs from a model (``service.interface.Engine``)."""

    def __init__(self, manifest_or_path: Manifest | str | Path, *, precision: str = "fp32",
                 provider: str = "cpu", intra_op_threads: int | None = None,
                 limits: Limits = Limits(), decoder_spinning: bool = True,
                 int8_form: FormChoice = FormChoice.AUTO,
                 shortlist: ShortlistChoice = ShortlistChoice.AUTO, packed_attention: bool = True,
                 shared_pool: bool = False, fused_attention: bool = True,
                 fused_encoder: bool = True, step_threads: int | None = None) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if provider not in PROVIDERS:
            raise ValueError(f"provider must be one of {sorted(PROVIDERS)}, got {provider!r}")
        manifest = (manifest_or_path if isinstance(manifest_or_path, Manifest)
                    else load_manifest(Path(manifest_or_path)))
        self.manifest, self.limits, self.precision = manifest, limits, precision
        self.tokenizer = _tokenizer(manifest)
        self.special = manifest.special
        self.vocab_size = manifest.model_config.tgt_vocab_size
        record = manifest.raw.get("shortlist")
        use, self.shortlist_reason = decide_shortlist(shortlist, record, precision=precision)
        lists = load_shortlist(manifest.path(record["file"]), always=always_ids(self.tokenizer.target)) if use else None
        self.runtime = Runtime(manifest, precision=precision, provider=provider,
                               intra_op_threads=intra_op_threads, decoder_spinning=decoder_spinning,
                               int8_form=int8_form, shortlist=lists, packed_attention=packed_attention,
                               shared_pool=shared_pool, fused_attention=fused_attention,
                               fused_encoder=fused_encoder, step_threads=step_threads)
        if self.runtime.shortlist_rows:
            self.shortlist_reason += f"; each row over its own words, middle {self.runtime.middle_form}"
        self.max_source_tokens = min(limits.max_source_tokens, manifest.max_source_tokens)
        self.construction = dict(precision=precision, provider=provider, intra_op_threads=intra_op_threads,
                                 limits=limits, decoder_spinning=decoder_spinning, int8_form=int8_form,
                                 shortlist=shortlist, packed_attention=packed_attention, shared_pool=shared_pool,
                                 fused_attention=fused_attention, fused_encoder=fused_encoder,
                                 step_threads=step_threads)
        """How it was made: another process builds the same engine from this and the manifest's root
        (``service.scheduling.remote``)."""

    def prepare_text(self, text: str, options: DecodingOptions, index: int) -> Prepared:
        """Tokenize one text of a validated request, with placeholder protection.

        Raises NmtError (INVALID_ARGUMENT) naming ``texts[index]`` when the text has
        more source tokens than the model takes.
        """
        encoded = self.tokenizer.encode(text)
        if len(encoded.ids) > self.max_source_tokens:
            raise invalid(f"texts[{index}]", f"at most {self.max_source_tokens} source tokens "
                          "(the model's maximum input, EOS included)", len(encoded.ids))
        return Prepared(text=text, source_ids=tuple(encoded.ids), source_pieces=tuple(encoded.pieces),
                        placeholders=encoded.placeholders, options=options)

    @property
    def int8_form(self) -> str:
        """The int8 products' form in use ("u8s8", "u8u8"; "" for fp32 graphs and on CUDA)."""
        form = self.runtime.int8_form
        return form.value if form is not None else ""

    @property
    def shortlist(self) -> bool:
        """Whether steps project onto the texts' shortlist candidates (``--shortlist``)."""
        return self.runtime.shortlist is not None

    def graph_shapes(self) -> dict[str, dict[str, list[int | str | None]]]:
        """Each graph's inputs and outputs as loaded, name -> shape (sizes and axis names), for
        the check against the manifest's model config (``service.app.check_engine``)."""
        return self.runtime.graph_shapes()

    def new_batch(self) -> Batch:
        """An empty running batch on this engine's sessions."""
        return Batch(self.runtime, special=self.special, vocab_size=self.vocab_size)

    def encode(self, items: Sequence[tuple[Key, Prepared]]) -> Encoded:
        """Run the encoder on texts for one of this engine's batches (``Batch.join``): with
        ``--engine-process on``, the server process encodes while the child steps."""
        return encode(self.runtime, self.special.pad, items)

    def translation(self, prepared: Prepared, decoded: Decoded) -> Translation:
        return render.translation(self.tokenizer, prepared, decoded)

    def partial_text(self, prepared: Prepared, ids: Sequence[int]) -> str:
        return render.partial_text(self.tokenizer, prepared, ids)

    def translate(self, texts: Sequence[str], options: DecodingOptions = DecodingOptions()
                  ) -> list[Translation]:
        """Validate, then translate ``texts`` in one batch; results in input order. (Any
        number of texts: ``Limits.max_texts`` bounds a request, not a batch.)"""
        validate_request(texts, options, dataclasses.replace(self.limits, max_texts=max(1, len(texts))))
        prepared = [self.prepare_text(text, options, i) for i, text in enumerate(texts)]
        return [self.translation(p, d) for p, d in zip(prepared, self.decode(prepared))]

    def decode(self, prepared: Sequence[Prepared]) -> list[Decoded]:
        """Decode prepared texts in one batch, in token ids; results in input order."""
        batch = self.new_batch()
        batch.add([((0, i), p) for i, p in enumerate(prepared)])
        results: dict = {}
        while batch.live_rows:
            results.update(batch.step())
        return [results[(0, i)] for i in range(len(prepared))]


def _tokenizer(manifest: Manifest) -> Tokenizer:
    try:
        return Tokenizer(manifest.path(manifest.source_tokenizer), manifest.path(manifest.target_tokenizer),
                         special=manifest.special)
    except ValueError as e:
        raise ModelRepositoryError(str(e)) from None
