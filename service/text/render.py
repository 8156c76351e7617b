"""Token ids into text: hypotheses with placeholders restored, alignments, streaming prefixes.

The one place where decoded ids become what a client reads. A finished
hypothesis gets every placeholder of its source back (``placeholders.restore``);
an unfinished streaming prefix gets the ones it has so far (the same restorer,
``complete=False``).
"""

from __future__ import annotations

from typing import Sequence

from service.interface import Alignment, Decoded, Finished, Hypothesis, Prepared, Translation
from service.text.tokenizer import Tokenizer


def translation(tokenizer: Tokenizer, prepared: Prepared, decoded: Decoded) -> Translation:
    return Translation(hypotheses=tuple(hypothesis(tokenizer, prepared, f) for f in decoded.hypotheses),
                       source_tokens=prepared.source_pieces[:-1], steps=decoded.steps)


def hypothesis(tokenizer: Tokenizer, prepared: Prepared, finished: Finished) -> Hypothesis:
    tokens = list(finished.tokens)
    options = prepared.options
    alignments: tuple[Alignment, ...] = ()
    if options.return_attention and finished.attention is not None:
        rows = finished.attention[: len(tokens)]  # (tokens, src_len): the EOS row is not a token's
        alignments = tuple(
            Alignment(target_index=i, source_index=int(j), source_token=prepared.source_pieces[int(j)],
                      weights=tuple(float(w) for w in row))
            for i, (row, j) in enumerate(zip(rows, rows.argmax(axis=1))))
    return Hypothesis(text=tokenizer.decode(tokens, prepared.placeholders),
                      score=float(finished.score) if options.return_scores else 0.0,
                      tokens=tuple(tokenizer.target_pieces(tokens)), alignments=alignments)


def partial_text(tokenizer: Tokenizer, prepared: Prepared, ids: Sequence[int]) -> str:
    """An unfinished prefix: the placeholders it has restored, none appended."""
    return tokenizer.decode(list(ids), prepared.placeholders, complete=False)
