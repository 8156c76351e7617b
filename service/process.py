"""Process-level tuning: how many cores this process may use, and giving freed memory back.

Below ``service.app`` (which asks it how many intra-op threads an engine gets and calls
``release_memory`` when a model version unloads) and above ``service.config`` only: it
knows nothing of models, requests or transports. Both answers are about the container
the server runs in, which ONNX Runtime and glibc do not look at by themselves.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
from pathlib import Path

from service.config import ServeConfig

CGROUP = Path("/sys/fs/cgroup")


def cpu_quota(cgroup: Path = CGROUP) -> int | None:
    """The CPU limit of this process's container (cgroup v2 ``cpu.max``, else v1's CFS quota),
    rounded up to whole cores; None without one. ONNX Runtime does not read it: left to its
    default, a pod limited to 2 cores of a 64-core node runs 64 threads and is throttled."""
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        quota = int((cgroup / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu" / "cpu.cfs_period_us").read_text())
        return max(1, math.ceil(quota / period)) if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def cores() -> tuple[int, bool]:
    """The cores this process may use, and whether a container's CPU limit set them: its CPU set
    (not the host's count), capped by ``cpu_quota``."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except AttributeError:  # no sched_getaffinity (macOS)
        allowed = os.cpu_count() or 1
    quota = cpu_quota()
    return (quota, True) if quota is not None and quota < allowed else (allowed, False)


def engine_threads(config: ServeConfig, models: int) -> int | None:
    """Intra-op threads for each of ``models`` engines: ``--threads`` when set; else the cores
    divided among the models, at least one each, and for one model without a CPU limit ONNX
    Runtime's own default (a thread per physical core). Measured
    (``loadtest/results/two_models.md``): two engines of 2 spinning threads on 2 cores serve 0.61x
    of one model alone, of 1 thread each 1.19x."""
    if config.threads:
        return config.threads
    count, limited = cores()
    return None if models <= 1 and not limited else max(1, count // models)


def release_memory() -> None:
    """Give the memory of an unloaded model back to the OS.

    Its ONNX Runtime sessions free their arenas, but glibc keeps the freed pages
    for later mallocs, and RSS grows with every reload (measured:
    ``loadtest/results/notes.md``, ``loadtest/results/reload_memory.md``). A no-op
    where there is no glibc.
    """
    gc.collect()  # the engine's sessions, once nothing refers to them
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
