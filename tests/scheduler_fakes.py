"""The scheduler tests' stand-ins: texts made without a tokenizer, and an engine without a model.

``FakeEngine`` decodes text "n" in n steps (the ``service.interface.Engine`` shape), so
``tests/test_scheduler.py`` (the pure state) and ``tests/test_scheduler_handle.py`` (the
async handle) test batching with no model at all.
"""

from __future__ import annotations

import threading
import time
from typing import Hashable, Sequence

from service.config import SchedulerConfig
from service.interface import Decoded, Finished, Hypothesis, Prepared, Translation
from service.options import DecodingOptions


def prep(steps: int = 3, *, length: int = 4, beam: int = 1) -> Prepared:
    """A text the fake engine decodes in ``steps`` steps; ``length`` source pieces."""
    return Prepared(text=str(steps), source_ids=tuple(range(4, 4 + length - 1)) + (3,),
                    source_pieces=("x",) * length, placeholders=(),
                    options=DecodingOptions(beam_size=beam, num_hypotheses=1))


def config(**overrides: object) -> SchedulerConfig:
    base = dict(max_rows=8, max_tokens=1000, max_wait=0.01, max_queued_work=10_000, step_level=True)
    return SchedulerConfig(**{**base, **overrides})


class FakeBatch:
    """Decodes text "n" in n steps into text[::-1]; records which thread did what."""

    def __init__(self, engine: FakeEngine) -> None:
        self.engine = engine
        self.live: dict[Hashable, list] = {}  # key -> [prepared, steps done]

    def add(self, items: Sequence[tuple[Hashable, Prepared]]) -> None:
        self.engine.record("add", [k for k, _ in items])
        for key, p in items:
            self.live[key] = [p, 0]

    def step(self) -> list[tuple[Hashable, Decoded]]:
        self.engine.record("step", self.live_rows)
        if self.engine.fail:
            raise RuntimeError("onnxruntime exploded")
        time.sleep(self.engine.step_seconds)
        done = []
        for key, item in list(self.live.items()):
            item[1] += 1
            if item[1] >= int(item[0].text):
                del self.live[key]
                hyp = Finished(tokens=(7,) * item[1], score=-1.0, length=item[1], normalized=-1.0)
                done.append((key, Decoded(hypotheses=(hyp,), steps=item[1])))
        return done

    def remove(self, keys: Sequence[Hashable]) -> None:
        self.engine.record("remove", list(keys))
        for key in keys:
            del self.live[key]

    def prefix(self, key: Hashable) -> list[int]:
        return [7] * self.live[key][1]

    @property
    def live_rows(self) -> int:
        return sum(p.rows for p, _ in self.live.values())

    @property
    def padded_tokens(self) -> tuple[int, int]:
        lengths = [len(p.source_ids) for p, _ in self.live.values()]
        return sum(lengths), len(lengths) * max(lengths, default=0)


class FakeEngine:
    def __init__(self, step_seconds: float = 0.0) -> None:
        self.step_seconds, self.fail = step_seconds, False
        self.calls: list[tuple[str, object]] = []
        self.threads: set[str] = set()  # threads that ran the batch
        self.rendered: set[str] = set()  # threads that made text

    def record(self, what: str, arg: object) -> None:
        self.calls.append((what, arg))
        self.threads.add(threading.current_thread().name)

    def new_batch(self) -> FakeBatch:
        return FakeBatch(self)

    def translation(self, prepared: Prepared, decoded: Decoded) -> Translation:
        self.rendered.add(threading.current_thread().name)
        best = decoded.hypotheses[0]
        hyp = Hypothesis(text=f"t{prepared.text}", score=best.score, tokens=("t",) * len(best.tokens))
        return Translation(hypotheses=(hyp,), source_tokens=("x",), steps=decoded.steps)

    def partial_text(self, prepared: Prepared, ids: Sequence[int]) -> str:
        return "a" * len(ids)
