"""Attention heatmaps: the greedy alignment of a sentence, one panel per model.

``nmt evaluate`` draws its ``heatmap-<k>.png`` with ``heatmap``; ``nmt compare``
draws the family side by side with ``plot_attention``.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

from export.train.model import RNNSearch
from export.train.search import greedy
from export.train.training import collate
from service.text.tokenizer import Tokenizer


def heatmap(model: RNNSearch, tok: Tokenizer, sentence: str, path: Path) -> str:
    """Plot the greedy attention of one sentence; returns the translation."""
    return plot_attention({"greedy": (model, tok)}, sentence, path)["greedy"]


def plot_attention(models: dict[str, tuple[RNNSearch, Tokenizer]], sentence: str, path: Path) -> dict[str, str]:
    """One panel per attention system (each with its own pieces), sized by the sentence; returns
    the translations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for name, (model, tok) in models.items():
        enc = tok.encode(sentence)
        src, lengths, _, _ = collate([(enc.ids, [tok.target.eos_id()])])
        hyp = greedy(model, src, lengths)[0]
        panels.append((name, hyp, tok.decode(hyp.tokens, enc.placeholders),
                       [_label(p) for p in enc.pieces], [_label(p) for p in tok.target_pieces(hyp.tokens)] + ["</s>"]))
    cell = 0.42  # inches per source or target piece: labels never overlap
    width = max(4.5, 2.2 + cell * max(len(x) for *_, x, _ in panels))
    heights = [1.6 + cell * len(y) for *_, y in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, sum(heights) + 0.8),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (name, hyp, translation, xlabels, ylabels) in zip(axes[:, 0], panels):
        ax.imshow(np.asarray(hyp.attention), cmap="gray_r", vmin=0, vmax=1, aspect="equal")
        ax.set_xticks(range(len(xlabels)), xlabels, rotation=60, ha="left", fontsize=9)
        ax.set_yticks(range(len(ylabels)), ylabels, fontsize=9)
        ax.xaxis.tick_top()
        ax.set_xlabel("\n".join(textwrap.wrap(f"{name}: {_label(translation)}", 70)), fontsize=9)
    fig.suptitle("\n".join(textwrap.wrap(sentence, 80)), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return {name: translation for name, _, translation, *_ in panels}


def _label(piece: str) -> str:
    """Reserved placeholder tokens drawn as <phK> (the plot font has no ｟ ｠)."""
    # (and their NFKC forms, U+2985 and U+2986, which SentencePiece's normalizer may leave)
    return piece.replace("\uff5f", "<ph").replace("\uff60", ">").replace("\u2985", "<ph").replace("\u2986", ">")
