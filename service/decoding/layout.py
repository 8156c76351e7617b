"""The per-row context of a running batch (annotations, keys, source mask) and how rows move.

A text owns ``beam_size`` contiguous rows (a block). The context is the costly
part to move (rows x src_len x 1,024 floats), so a text that leaves is
replaced in place by a text from the end of the batch (``compact_order``), the
other rows stay where they are, and the arrays keep room after the live rows
for texts that join. Where the step is the fused attention (the int8 CPU
default), which reads each row where it lies, rows do not move at all
(``SlottedContext``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from service.decoding.arrays import Context

if TYPE_CHECKING:  # runtime imports packed, which imports this module
    from service.decoding.runtime import Runtime

NO_ROWS = np.zeros(0, dtype=np.int64)
PAD_COLUMNS = 1  # masked source columns every row gets (see ``width``)
WIDTH_MULTIPLE = 4  # every src_len the decoder step sees is a multiple of this (see ``width``)
WIDTH_SLACK = 1.25  # keep up to 25% unneeded columns rather than copy the context to trim them
MAX_MOVED_SHARE = 0.5  # above this share of rows moving, build a fresh context instead
SLOTTED_WIDTH_SLACK = 2  # a slotted store (``SlottedContext``) keeps up to twice the columns its rows need
GROWTH, MIN_CAPACITY = 2, 16  # a new context allocation has room for this many times its rows
# An encoder run's fixed cost, in padded source tokens: en-fr/3's int8 encoder, 2 threads, AMD Zen 3
# (AVX2), costs about 0.39 ms a run plus 23 us per padded token (rows x the run's longest source)
# (``loadtest/bench_encoder_runs.py``)
ENCODER_RUN_TOKENS = 16


def width(longest_source: int) -> int:
    """The rows' src_len: the longest source plus ``PAD_COLUMNS`` masked columns, rounded up to
    a multiple of ``WIDTH_MULTIPLE``.

    ONNX Runtime's results for a row depend on the batch's shape in the last bit
    unless both hold (measured, ``export.parity.check_padding``): a row exactly as
    wide as its source can differ, and a ``Gemm`` over rows x src_len columns (the
    int8 step's attention score) computes a column in a tail group of fewer than 4
    differently. With both, a text decodes to the same bits alone or in any batch.
    """
    columns = longest_source + PAD_COLUMNS
    return -(-columns // WIDTH_MULTIPLE) * WIDTH_MULTIPLE


def source_mask(lengths: Sequence[int], columns: int) -> np.ndarray:
    return np.arange(columns)[None, :] < np.asarray(lengths)[:, None]  # (batch, src_len) bool


def pad_sources(sources: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Source id lists -> (src_ids (batch, src_len) padded with ``pad_id``, lengths (batch,))."""
    lengths = np.array([len(s) for s in sources], dtype=np.int64)
    src = np.full((len(sources), int(lengths.max())), pad_id, dtype=np.int64)
    for row, ids in enumerate(sources):
        src[row, : len(ids)] = ids
    return src, lengths


def encoder_runs(lengths: Sequence[int], run_tokens: int | None = None) -> list[tuple[int, int]]:
    """How to cut texts sorted longest first into encoder runs: (start, end) of each run, in order.

    The encoder's GRU computes every row of a run up to the run's longest source, so
    a run of mixed lengths pays for padding; each run also pays a fixed cost. The
    cuts minimise (rows x the run's longest source) summed over runs, plus
    ``run_tokens`` per run (default ``ENCODER_RUN_TOKENS``; dynamic programming over the
    sorted lengths).
    """
    run_tokens = ENCODER_RUN_TOKENS if run_tokens is None else run_tokens
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n and np.any(lengths[1:] > lengths[:-1]):
        raise ValueError("lengths must be sorted longest first")
    best = np.zeros(n + 1, dtype=np.int64)  # best[e]: the least cost of the first e texts
    cut = np.zeros(n + 1, dtype=np.int64)  # the start of the last run of that best
    for end in range(1, n + 1):
        costs = best[:end] + run_tokens + (end - np.arange(end)) * lengths[:end]
        cut[end] = int(np.argmin(costs))
        best[end] = costs[cut[end]]
    runs, end = [], n
    while end:
        runs.append((int(cut[end]), end))
        end = int(cut[end])
    return runs[::-1]


def compact_order(sizes: Sequence[int], keep: Sequence[bool]) -> list[int]:
    """The kept blocks (``sizes`` rows each, in row order) in the order of a new layout that
    moves as few rows as possible.

    Blocks that lie inside the new layout (its first ``sum of kept sizes`` rows)
    stay; each kept block past its end moves into a dropped block of the same
    size inside it. When that cannot tile the new layout exactly, the kept
    blocks keep their relative order (everything after a leaver moves up).
    """
    if all(size == 1 for size in sizes):  # one row each (greedy): the same order without the offsets
        n = sum(map(bool, keep))
        movers = (i for i in range(n, len(keep)) if keep[i])  # into the holes, in order
        return [i if keep[i] else next(movers) for i in range(n)]
    kept = [i for i, k in enumerate(keep) if k]
    offsets = np.cumsum([0, *sizes]).tolist()
    n = sum(sizes[i] for i in kept)
    position = {i: offsets[i] for i in kept if offsets[i + 1] <= n}
    holes = [i for i, k in enumerate(keep) if not k and offsets[i + 1] <= n and sizes[i]]
    for i in kept:
        if i in position:
            continue
        hole = next((h for h in holes if sizes[h] == sizes[i]), None) if offsets[i] >= n else None
        if hole is None:
            return kept
        holes.remove(hole)
        position[i] = offsets[hole]
    return sorted(position, key=position.__getitem__)


def block_rows(offsets: np.ndarray, order: Sequence[int]) -> np.ndarray:
    """(rows,) the rows of blocks ``order`` (block i: rows offsets[i] to offsets[i + 1]), in order."""
    order = np.asarray(order, dtype=np.int64)
    if not len(order):
        return NO_ROWS
    starts = np.asarray(offsets)[order]
    sizes = np.asarray(offsets)[order + 1] - starts
    # each block's rows: its start, plus the position within the block
    return np.repeat(starts - (np.cumsum(sizes) - sizes), sizes) + np.arange(int(sizes.sum()))


class RowContext:
    """Host copies of the rows' context, and the provider's form of it (``Runtime.context``)."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self.arrays: tuple[np.ndarray, ...] = ()  # annotations, keys, mask: (rows, src_len, ...)
        self._backing: tuple[np.ndarray, ...] = ()  # the arrays they are the first rows of
        self.device: Any = None  # what the decoder step reads

    @property
    def columns(self) -> int:
        return self.arrays[2].shape[1] if self.arrays else 0

    def clear(self) -> None:
        self.arrays, self._backing, self.device = (), (), None

    def append(self, parts: Sequence[tuple[np.ndarray, ...]], columns: int) -> None:
        """Append rows after the live rows: ``parts``, each (annotations, keys, mask) of
        (part_rows, src_len, ...) (one per encoder run), zero-padded (mask: False) to ``columns``."""
        start = len(self.arrays[0]) if self.arrays else 0
        end = start + sum(len(part[0]) for part in parts)
        if self.arrays and columns == self.columns and end <= len(self._backing[0]):
            backing = self._backing  # room after the live rows: the kept rows are not copied
        else:  # a wider source or no room: a new allocation, with room for texts joining later
            backing = tuple(np.zeros((max(end * GROWTH, MIN_CAPACITY), columns, *b.shape[2:]), dtype=b.dtype)
                            for b in parts[0])
            for target, rows in zip(backing, self.arrays):
                target[:start, : rows.shape[1]] = rows
        for part in parts:
            stop = start + len(part[0])
            for target, rows in zip(backing, part):
                target[start:stop, : rows.shape[1]] = rows
                target[start:stop, rows.shape[1]:] = 0
            start = stop
        self._backing = backing
        self._publish(tuple(b[:end] for b in backing))

    def gather(self, row_index: np.ndarray, columns: int) -> None:
        """Keep rows ``row_index`` of the current layout (rows only leave here), trimmed to
        ``columns`` when that saves enough."""
        n, current = len(row_index), self.columns
        moved = np.flatnonzero(row_index != np.arange(n))
        if columns * WIDTH_SLACK >= current and len(moved) <= n * MAX_MOVED_SHARE:
            # rows stay where they are and a few move into the leavers' places (``compact_order``),
            # in place (the right side is gathered before it is written); then a view of the first
            # rows. Extra masked columns do not change any row's result (see ``width``).
            for a in self.arrays:
                a[moved] = a[row_index[moved]]
            self._publish(tuple(a[:n] for a in self.arrays))
        else:
            self._backing = tuple(a[row_index, :columns] for a in self.arrays)
            self._publish(self._backing)

    def _publish(self, arrays: tuple[np.ndarray, ...]) -> None:
        self.arrays = arrays
        self.device = self._runtime.context(*arrays)


def row_context(runtime: Runtime) -> RowContext | SlottedContext:
    """The context store for a batch on ``runtime``: slotted where its steps read rows where they lie."""
    return SlottedContext(runtime) if getattr(runtime, "attention_form", "") == "fused" else RowContext(runtime)


class SlottedContext:
    """``RowContext`` for a step that reads row r's annotations and keys at ``slots[r]`` (the fused
    attention): each row's stay in the slot they were written to. A text that leaves frees its rows'
    slots and texts that join take free ones, so no row is copied for the others' sake (``RowContext``
    moves rows into the leavers' places, and copies every row to trim the width or make room); only the
    mask (rows, columns) is kept in row order. A wider source, a full store, or a store more than
    ``SLOTTED_WIDTH_SLACK`` times as wide as its rows need (memory: a row costs a step its own columns
    only) moves the live rows to a new store, with room for ``GROWTH`` times as many. A slot's columns
    past its row's source are never read: a new store is not zeroed."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self.arrays: tuple[np.ndarray, ...] = ()  # annotations, keys: (places, src_len, ...); mask: (rows, src_len)
        self.slots = NO_ROWS  # (rows,) each live row's place
        self._free: list[int] = []  # free places, the lowest last
        self.device: Any = None

    @property
    def columns(self) -> int:
        return self.arrays[2].shape[1] if self.arrays else 0

    def clear(self) -> None:
        self.arrays, self.slots, self._free, self.device = (), NO_ROWS, [], None

    def append(self, parts: Sequence[tuple[np.ndarray, ...]], columns: int) -> None:
        """Add rows after the live rows: ``parts``, each (annotations, keys, mask) of (part_rows,
        src_len, ...), the mask padded (False) to ``columns``."""
        rows = sum(len(part[0]) for part in parts)
        if not self.arrays or columns > self.columns or rows > len(self._free):
            self._store(max(columns, self.columns), max((len(self.slots) + rows) * GROWTH, MIN_CAPACITY), parts[0])
        taken = np.array([self._free.pop() for _ in range(rows)], dtype=np.int64)
        masks, start = [self.arrays[2]], 0
        for annotations, keys, mask in parts:
            places, width = taken[start:start + len(annotations)], annotations.shape[1]
            self.arrays[0][places, :width], self.arrays[1][places, :width] = annotations, keys
            masks.append(np.zeros((len(mask), self.columns), dtype=bool))
            masks[-1][:, :width] = mask
            start += len(annotations)
        self.slots = np.concatenate([self.slots, taken])
        self._publish(np.concatenate(masks))

    def gather(self, row_index: np.ndarray, columns: int) -> None:
        """Keep rows ``row_index`` (rows only leave here): their slots stay, the others are freed."""
        leaving = np.ones(len(self.slots), dtype=bool)
        leaving[row_index] = False
        self._free.extend(self.slots[leaving].tolist())
        self.slots = self.slots[row_index]
        self.arrays = (*self.arrays[:2], self.arrays[2][row_index])
        if columns * SLOTTED_WIDTH_SLACK < self.columns:
            self._store(columns, max(len(self.slots) * GROWTH, MIN_CAPACITY), self.arrays)
        self._publish(self.arrays[2])

    def _store(self, columns: int, places: int, like: Sequence[np.ndarray]) -> None:
        """A new store of ``places`` slots of ``columns`` (trailing sizes and types of ``like``'s
        annotations and keys), the live rows copied to its first slots."""
        live = len(self.slots)
        store = tuple(np.empty((places, columns, *a.shape[2:]), dtype=a.dtype) for a in like[:2])
        mask = np.zeros((live, columns), dtype=bool)
        if self.arrays:
            width = min(columns, self.columns)
            for target, old in zip(store, self.arrays[:2]):
                target[:live, :width] = old[self.slots, :width]
            mask[:, :width] = self.arrays[2][:, :width]
        self.arrays, self.slots = (*store, mask), np.arange(live, dtype=np.int64)
        self._free = list(range(places - 1, live - 1, -1))

    def _publish(self, mask: np.ndarray) -> None:
        self.arrays = (*self.arrays[:2], mask)
        self.device = Context(*self.arrays, slots=self.slots)  # the fused attention's: on the CPU, as it is
