"""Threads' CPU in short bins: which thread runs while which waits (Linux ``/proc``).

``bench_cpu_split.py --bins-ms 10`` uses it: a saturated server's threads are grouped (event loop,
driver, engine process, ...); a process of its own reads each thread's time on CPU from
``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds) every ``period`` seconds, and ``binned`` turns
the readings into cores per group in bins of ``bin_s`` seconds. Averages over a whole round hide
the phases of a closed loop (a batch that drains while the event loop answers a wave of calls);
the bins show them: ``by_busy`` sorts the bins by how busy one group was and gives the others'
means beside it, ``longest_below`` the longest stretch of bins a group spent (nearly) idle.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import statistics
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

BUCKETS = ((0.0, 0.2), (0.2, 0.6), (0.6, 0.9), (0.9, float("inf")))
"""``by_busy``'s ranges of one group's cores in a bin."""


def threads(pids: Iterable[int]) -> Iterator[tuple[int, int, str, Path]]:
    """(pid, tid, name, ``/proc/<pid>/task/<tid>``) of every live thread of ``pids``."""
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:  # the process ended meanwhile
            continue
        for task in tasks:
            try:
                name = (task / "comm").read_text().strip()
            except OSError:  # the thread ended meanwhile
                continue
            yield pid, int(task.name), name, task


def schedstat_paths(pids: Iterable[int], group: Callable[[int, int, str], str]) -> dict[str, str]:
    """``/proc/<pid>/task/<tid>/schedstat`` -> ``group(pid, tid, name)``, for every live thread of ``pids``."""
    return {str(task / "schedstat"): group(pid, tid, name) for pid, tid, name, task in threads(pids)}


def sample(paths: Sequence[str], seconds: float, period: float) -> list[list[float]]:
    """Every ``period`` s for ``seconds``: [time, each path's seconds on CPU so far]. A thread that
    ended keeps its last reading."""
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    rows: list[list[float]] = []
    last = [0.0] * len(paths)
    end = time.perf_counter() + seconds
    try:
        while (now := time.perf_counter()) < end:
            for i, fd in enumerate(fds):
                try:
                    last[i] = int(os.pread(fd, 128, 0).split()[0]) / 1e9
                except (OSError, ValueError, IndexError):  # ended: its time stays
                    pass
            rows.append([now, *last])
            time.sleep(period)
    finally:
        for fd in fds:
            os.close(fd)
    return rows


def _sample_into(conn, paths: Sequence[str], seconds: float, period: float, delay: float) -> None:
    conn.send("ready")
    time.sleep(delay)
    conn.send(sample(paths, seconds, period))
    conn.close()


def start_sampling(paths: Sequence[str], seconds: float, period: float, delay: float = 0.5
                   ) -> Callable[[], list[list[float]]]:
    """``sample`` in a process of its own (not this one's GIL: the clients run here), from ``delay`` s
    after this returns (the process is up by then) for ``seconds``; call the result to wait for its rows."""
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    process = context.Process(target=_sample_into, args=(theirs, list(paths), seconds, period, delay), daemon=True)
    process.start()
    theirs.close()
    if mine.recv() != "ready":
        raise RuntimeError("the sampling process did not start")

    def rows() -> list[list[float]]:
        got = mine.recv()
        process.join()
        return got
    return rows


def binned(rows: Sequence[Sequence[float]], groups: Sequence[str], bin_s: float) -> list[dict[str, float]]:
    """Cores per group in consecutive bins of about ``bin_s`` s (each from the reading that closes the
    one before to the first reading at or past its end); ``groups[i]`` names column ``i + 1``."""
    names = sorted(set(groups))
    out, start = [], 0
    for j in range(1, len(rows)):
        wall = rows[j][0] - rows[start][0]
        if wall < bin_s and j < len(rows) - 1:
            continue
        if wall > 0:
            used = dict.fromkeys(names, 0.0)
            for i, g in enumerate(groups):
                used[g] += rows[j][i + 1] - rows[start][i + 1]
            out.append({g: v / wall for g, v in used.items()})
        start = j
    return out


def by_busy(bins: Sequence[dict[str, float]], group: str) -> list[dict]:
    """For each of ``BUCKETS`` of ``group``'s cores (``range``: low, high or None): the share of bins
    there and every group's mean cores in them (``total``: all groups)."""
    out = []
    for low, high in BUCKETS:
        chosen = [b for b in bins if low <= b[group] < high]
        if chosen:
            means = {g: statistics.mean(b[g] for b in chosen) for g in chosen[0]}
            out.append({"range": (low, None if math.isinf(high) else high), "share": len(chosen) / len(bins),
                        "means": means, "total": statistics.mean(sum(b.values()) for b in chosen)})
    return out


def longest_below(bins: Sequence[dict[str, float]], group: str, cores: float) -> int:
    """The most consecutive bins in which ``group`` ran under ``cores``."""
    best = run = 0
    for b in bins:
        run = run + 1 if b[group] < cores else 0
        best = max(best, run)
    return best
