"""The enum-like settings of ``nmt serve`` (``service.config``), one ``StrEnum`` each.

A member is its flag value (``Precision.INT8 == "int8"``, ``f"{Precision.INT8}"`` prints ``int8``),
so flags, variables, log lines and metric labels read as they did when these were strings.
"""

from __future__ import annotations

import argparse
import enum
from typing import Callable


class Precision(enum.StrEnum):  # which graphs an engine runs
    AUTO = "auto"  # each model's measured choice (``Manifest.default_precision``)
    FP32 = "fp32"
    INT8 = "int8"


class Provider(enum.StrEnum):  # the ONNX Runtime execution provider
    CPU = "cpu"
    CUDA = "cuda"


class Batching(enum.StrEnum):  # when queued texts join the running batch
    STEP = "step"  # between decoder steps (continuous batching)
    REQUEST = "request"  # only once the running batch is empty (the benchmark baseline)


class ModelControl(enum.StrEnum):  # when the repository is looked at again (SIGHUP: either mode)
    NONE = "none"  # at start only
    POLL = "poll"  # every --poll-seconds


class ModelVersions(enum.StrEnum):  # which versions of a model name serve
    LATEST = "latest"  # the newest; a newer one replaces it
    ALL = "all"  # every version found (a request pins one with name/version)


class LogLevel(enum.StrEnum):
    DEBUG = "debug"  # one line per request
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


class Int8Form(enum.StrEnum):  # how the int8 products multiply (service.decoding.int8_form)
    AUTO = "auto"  # u8s8 where the CPU has AVX-512 VNNI, AVX-VNNI or AMX, else u8u8
    U8S8 = "u8s8"  # weights converted to int8 in memory: exact and fast with VNNI or AMX
    U8U8 = "u8u8"  # the graphs as shipped: exact on every CPU


class Shortlist(enum.StrEnum):  # the lexical shortlist (service.decoding.shortlist)
    OFF = "off"  # the whole vocabulary at every step
    AUTO = "auto"  # on where the manifest shows it within 0.3 BLEU of the whole vocabulary
    ON = "on"  # whenever the repository has one


class EngineProcess(enum.StrEnum):  # where each model's batches decode (service.scheduling.remote)
    AUTO = "auto"  # in a child process for one model with the CPU provider on 2 or more cores
    ON = "on"  # in a child process per model
    OFF = "off"  # in the server process (its engine thread)


class SchedBatch(enum.StrEnum):  # the Linux policy of nmt serve's threads (service.process.sched_batch)
    AUTO = "auto"  # SCHED_BATCH where the batches decode in an engine process, else as started
    ON = "on"
    OFF = "off"


class Switch(enum.StrEnum):  # an on/off flag (``--reflection off``); the config holds a bool
    ON = "on"
    OFF = "off"


def converter(kind: type[enum.StrEnum]) -> Callable[[str], enum.StrEnum]:
    """A flag's converter to a member of ``kind``, from its value in any case."""
    def convert(text: str) -> enum.StrEnum:
        try:
            return kind(text.lower())
        except ValueError:
            choices = ", ".join(m.value for m in kind)
            raise argparse.ArgumentTypeError(f"must be one of {choices}, got {text!r}") from None
    return convert
