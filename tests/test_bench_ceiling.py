"""``loadtest/bench_ceiling.py``'s engine alone: the serving engine's loop with nothing around it."""

from __future__ import annotations

from pathlib import Path


def test_the_engine_alone_keeps_its_batch_full_and_accounts_for_its_time(
        reversal_repository: Path, reversal_corpus: Path) -> None:
    from loadtest import bench_ceiling

    got = bench_ceiling.engine_round(reversal_repository, reversal_corpus / "test.jsonl", rows=6, duration=1.0)
    assert got["rows_per_step"] == 6  # each finished text replaced by a new one before the next step
    assert got["texts_per_s"] > 0 and got["steps_per_s"] > got["texts_per_s"] / 6
    assert 0.5 < got["in_steps"] + got["in_joins"] <= 1.0 and got["in_joins"] > 0
