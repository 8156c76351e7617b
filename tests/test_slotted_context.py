"""The slotted context (``layout.SlottedContext``): with the fused attention, each row's annotations
and keys stay where they were written and the kernel reads row r at ``slots[r]``; texts leaving and
joining move no other row. Checked on the kernel, on the store's bookkeeping, and on decoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from service.decoding import layout
from service.decoding.engine import Engine
from service.options import DecodingOptions

_attention = pytest.importorskip("service.decoding._attention", reason="installed without a C compiler")


def _attend(product, keys, annotations, lengths, v, slots=None):
    rows = len(lengths)
    alpha = np.full((rows, keys.shape[1]), np.nan, np.float32)
    context = np.full((rows, annotations.shape[2]), np.nan, np.float32)
    _attention.attend(product, keys, annotations, lengths, v, alpha, context, 1, *(() if slots is None else (slots,)))
    return alpha, context


def test_kernel_reads_each_row_at_its_slot_with_the_bits_of_the_row_in_place() -> None:
    rng = np.random.default_rng(5)
    rows, places, src_len, A, C = 7, 19, 11, 32, 24
    lengths = rng.integers(1, src_len + 1, rows).astype(np.int64)
    product = rng.normal(0, 2, (rows, A)).astype(np.float32)
    keys = rng.normal(0, 2, (rows, src_len, A)).astype(np.float32)
    annotations = rng.uniform(-1, 1, (rows, src_len, C)).astype(np.float32)
    v = rng.normal(0, 0.3, A).astype(np.float32)
    slots = rng.permutation(places)[:rows].astype(np.int64)
    store_k = rng.normal(0, 50, (places, src_len, A)).astype(np.float32)  # whatever lies elsewhere
    store_a = rng.normal(0, 50, (places, src_len, C)).astype(np.float32)
    for r, s in enumerate(slots):  # a row's own columns; past its length the slot keeps what it had
        store_k[s, :lengths[r]], store_a[s, :lengths[r]] = keys[r, :lengths[r]], annotations[r, :lengths[r]]
    assert all(np.array_equal(a, b) for a, b in zip(_attend(product, store_k, store_a, lengths, v, slots),
                                                     _attend(product, keys, annotations, lengths, v)))
    for bad in (slots[:-1], np.where(slots == slots[0], places, slots), np.where(slots == slots[0], -1, slots)):
        with pytest.raises(ValueError, match="every slot in"):
            _attend(product, store_k, store_a, lengths, v, np.ascontiguousarray(bad, dtype=np.int64))
    with pytest.raises(ValueError, match="shapes do not agree"):  # without slots, one row per place
        _attend(product, store_k, store_a, lengths, v)


class _Runtime:
    attention_form = "fused"


def _rows(rng, n, width, A=3, C=2):
    lengths = rng.integers(1, width + 1, n)
    return (rng.normal(size=(n, width, C)).astype(np.float32), rng.normal(size=(n, width, A)).astype(np.float32),
            np.arange(width)[None, :] < lengths[:, None])


def _check(store: layout.SlottedContext, rows: list) -> None:
    """Row r of the store holds ``rows[r]`` (annotations, keys, mask) at its slot, its mask in row order."""
    annotations, keys, mask = store.arrays
    assert len(set(store.slots.tolist())) == len(store.slots) == len(rows) == len(mask)
    assert not set(store.slots.tolist()) & set(store._free)
    for r, (a, k, m) in enumerate(rows):
        n = int(m.sum())
        s = store.slots[r]
        assert np.array_equal(annotations[s, :n], a[:n]) and np.array_equal(keys[s, :n], k[:n])
        assert np.array_equal(mask[r, :len(m)], m) and not mask[r, len(m):].any()


def test_rows_stay_in_their_slots_and_leavers_free_theirs() -> None:
    rng = np.random.default_rng(0)
    store = layout.row_context(_Runtime())
    assert isinstance(store, layout.SlottedContext)
    first = _rows(rng, 5, 8)
    store.append([first], 8)
    places = len(store.arrays[0])
    rows = [tuple(x[i] for x in first) for i in range(5)]
    _check(store, rows)
    before = store.slots.copy()
    store.gather(np.array([0, 4, 2]), 8)  # rows 1 and 3 leave; the others keep their slots
    rows = [rows[0], rows[4], rows[2]]
    assert store.slots.tolist() == before[[0, 4, 2]].tolist()
    _check(store, rows)
    joining = [_rows(rng, 1, 8), _rows(rng, 1, 4)]
    store.append(joining, 8)  # the joiners take the freed slots
    assert sorted(store.slots[3:].tolist()) == sorted(before[[1, 3]].tolist())
    assert len(store.arrays[0]) == places  # no new store
    _check(store, rows + [tuple(x[0] for x in part) for part in joining])


def test_a_wider_source_or_a_full_store_moves_the_rows_and_a_far_narrower_batch_is_trimmed() -> None:
    rng = np.random.default_rng(1)
    store = layout.SlottedContext(_Runtime())
    parts = [_rows(rng, 4, 8)]
    store.append(parts, 8)
    rows = [tuple(x[i] for x in parts[0]) for i in range(4)]
    wide = _rows(rng, 2, 20)
    store.append([wide], 20)  # wider: a new store 20 columns wide, every row's data kept
    rows += [tuple(x[i] for x in wide) for i in range(2)]
    assert store.columns == 20
    _check(store, rows)
    many = _rows(rng, 40, 20)
    store.append([many], 20)  # more rows than free slots: a bigger store
    rows += [tuple(x[i] for x in many) for i in range(40)]
    assert len(store.arrays[0]) >= 46
    _check(store, rows)
    keep = np.array([0, 2, 3])  # the narrow rows (8 columns of 20): not yet half
    store.gather(keep, 12)
    assert store.columns == 20
    store.gather(np.array([0, 1]), 8)  # 8 of 20 columns: trimmed, the rows moved to a smaller store
    rows = [rows[0], rows[2]]
    assert store.columns == 8 and len(store.arrays[0]) == layout.MIN_CAPACITY
    _check(store, rows)


def test_slotted_batches_decode_to_the_bits_of_the_moving_layout(reversal_repository: Path,
                                                                  reversal_corpus: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Texts joining and leaving a running batch, mixed lengths and beams: the slotted store (served with the
    fused attention) gives every text the bits the moving layout gives it on the same kernel."""
    import json

    engine = Engine(reversal_repository, precision="int8", intra_op_threads=1)
    assert isinstance(engine.new_batch()._context, layout.SlottedContext)
    sources = [json.loads(line)["src_raw"] for line in (reversal_corpus / "test.jsonl").read_text().splitlines()]
    prepared = [(i, engine.prepare_text(s, DecodingOptions(beam_size=(1, 3, 2)[i % 3]), i))
                for i, s in enumerate(sources[:60])]

    def decode() -> dict:
        rng, pending, batch, results = np.random.default_rng(0), list(prepared), engine.new_batch(), {}
        while pending or batch.live_rows:
            n = int(rng.integers(0, 8))
            batch.add(pending[:n])
            pending = pending[n:]
            results.update(batch.step())
        return {key: [(h.tokens, h.score) for h in d.hypotheses] for key, d in results.items()}

    slotted = decode()
    monkeypatch.setattr(layout, "row_context", layout.RowContext)  # the rows moved to stay contiguous
    assert slotted == decode()
