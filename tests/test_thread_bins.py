"""``loadtest/thread_bins.py``: threads' CPU in short bins (``bench_cpu_split.py --bins-ms``)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from loadtest import thread_bins


def test_bins_are_cores_per_group_between_the_readings_that_close_them() -> None:
    # readings every 5 ms: "busy" gains 5 ms of CPU per reading, then nothing; "half" 2.5 ms throughout
    rows = [[i * 0.005, min(i, 4) * 0.005, 0.0, i * 0.0025] for i in range(9)]
    bins = thread_bins.binned(rows, ["busy", "idle", "half"], 0.010)
    assert len(bins) == 4
    assert [round(b["busy"], 6) for b in bins] == [1.0, 1.0, 0.0, 0.0]
    assert all(round(b["half"], 6) == 0.5 and b["idle"] == 0.0 for b in bins)
    # two columns of one group add up; a bin closes at the first reading at or past its end
    assert [round(b["two"], 6) for b in thread_bins.binned([[0.0, 0, 0], [0.004, 0.004, 0.004],
                                                             [0.012, 0.012, 0.012]], ["two", "two"], 0.010)] == [2.0]


def test_bins_sorted_by_one_groups_cores_and_its_longest_idle_stretch() -> None:
    bins = [{"engine": e, "loop": 1.0 - e} for e in (1.0, 0.1, 0.0, 0.7, 0.05, 0.95)]
    rows = {r["range"]: r for r in thread_bins.by_busy(bins, "engine")}
    assert set(rows) == {(0.0, 0.2), (0.6, 0.9), (0.9, None)}  # no bin in 0.2-0.6: no row
    low = rows[(0.0, 0.2)]
    assert low["share"] == pytest.approx(3 / 6) and low["means"]["loop"] == pytest.approx((0.9 + 1.0 + 0.95) / 3)
    assert rows[(0.9, None)]["total"] == pytest.approx(1.0)
    assert thread_bins.longest_below(bins, "engine", 0.2) == 2
    assert thread_bins.longest_below(bins, "loop", 0.0) == 0


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc only")
def test_a_spinning_thread_shows_as_a_core_and_a_sleeping_one_as_none() -> None:
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    def nap() -> None:
        stop.wait()

    threads = [threading.Thread(target=spin, name="spinner"), threading.Thread(target=nap, name="napper")]
    for t in threads:
        t.start()
    try:
        names = {t.native_id: t.name for t in threads}  # Python's names are not the OS's (comm)
        paths = thread_bins.schedstat_paths([os.getpid()], lambda pid, tid, name: names.get(tid, "rest"))
        assert sorted(set(paths.values())) == ["napper", "rest", "spinner"]
        # the main thread only waits for the rows here: the spinner holds the GIL, most of a core
        rows = thread_bins.start_sampling(list(paths), 0.4, 0.002, delay=0.05)()
    finally:
        stop.set()
        for t in threads:
            t.join()
    bins = thread_bins.binned(rows, list(paths.values()), 0.05)
    assert len(bins) >= 6
    mean = {g: sum(b[g] for b in bins) / len(bins) for g in ("spinner", "napper")}
    assert mean["spinner"] > 0.5 and mean["napper"] < 0.02
