"""Process-level tuning: how many cores this process may use, the cyclic collector, and giving freed memory back.

Below ``service.app`` (which asks it how many intra-op threads an engine gets and calls
``release_memory`` when a model version unloads) and above ``service.config`` only: it
knows nothing of models, requests or transports. Both answers are about the container
the server runs in, which ONNX Runtime and glibc do not look at by themselves.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import math
import os
from pathlib import Path
from typing import Iterator

from service.config import Provider, ServeConfig

CGROUP = Path("/sys/fs/cgroup")
PR_SET_NAME = 15  # prctl(2): name the calling thread


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
    of one model alone, of 1 thread each 1.19x. With ``--engine-process on`` the server process
    (gRPC, tokenizing, answering) keeps a core: the others are divided (at least one each)."""
    if config.threads:
        return config.threads
    count, limited = cores()
    if engine_process(config, models):
        return max(1, (count - 1) // models)
    return None if models <= 1 and not limited else max(1, count // models)


def step_threads(config: ServeConfig, models: int) -> int | None:
    """The server process's step threads with ``--engine-process``: its steps run only for a cycle
    that finds both processes idle (``service.scheduling.remote.LOCAL_ROWS``), so they may take every
    core, as in process (its texts wait for nothing else), while its encoder, which runs for the
    child at saturation, keeps ``engine_threads``. None (the engine's threads) otherwise, with
    ``--threads``, or for several models."""
    if config.threads or models > 1 or not engine_process(config, models):
        return None
    return cores()[0]


def engine_process(config: ServeConfig, models: int = 1) -> bool:
    """Whether each of ``models`` models' batches decode in a child process: ``--engine-process
    on``, or ``auto`` (the default) for one model with the CPU provider where this process may use
    2 or more cores and ``--threads`` is left to the server (on 2 cores: 1.75-1.92x f967d83's
    texts/s at saturation against 1.42-1.48x in process, idle latency that of in process since the
    server process's idle steps take every core; one model's start-up 1.2 s longer, about twice
    the memory: ``docs/serving.md``). Several models would each take a process and their memory
    again; a pinned ``--threads`` would be given to both processes."""
    if config.engine_process is not None:
        return config.engine_process
    return (models == 1 and config.provider is Provider.CPU and not config.threads
            and cores()[0] >= 2)


_SERVER: list[bool] = []  # [True] while ``nmt serve`` loads its first engines (``global_pools_allowed``)


@contextlib.contextmanager
def global_pools_allowed() -> Iterator[None]:
    """Around ``nmt serve``'s first engines: they may go on ONNX Runtime's global pools, which are
    process-wide and cannot be undone (``service.decoding.sessions``); engines embedded elsewhere
    (tests, benchmarks, an in-process server) keep a pool per session."""
    _SERVER.append(True)
    try:
        yield
    finally:
        _SERVER.clear()


def shared_pool(config: ServeConfig, threads: int | None) -> bool:
    """Whether an engine's encoder and decoder step run on ONNX Runtime's global pool (one thread
    per core, spinning) rather than a pool each: in ``nmt serve``, where the engine has the default
    threads (one model, no CPU limit, no ``--threads``), spinning on, on the CPU. The encoder's own
    pool does not spin (it would compete with the step's), so each of its runs wakes its threads;
    one spinning pool for both: 1.10x texts/s at saturation (``docs/speed-round2.md``). Once one
    engine is on it, models loaded later are too (ONNX Runtime's rule)."""
    return bool(_SERVER) and threads is None and config.decoder_spinning and config.provider.value == "cpu"


GEN0_THRESHOLD = 10_000  # allocations between the youngest generation's collections (Python's default: 700)


def freeze_heap() -> None:
    """What start-up left alive (modules, models, sessions) out of the cyclic collector's sight
    (``gc.freeze``): a full collection then traverses what serving allocates only (at one text per
    call in the server process: 1.4 ms instead of 37 ms, an event loop's pause), and the youngest
    generation is collected every ``GEN0_THRESHOLD`` allocations (0.27 s of collections in 10 s of
    saturation before, 0.04 s after: ``docs/speed-round2.md``). Called once the server (or an
    engine process) is ready."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])


def release_memory() -> None:
    """Give the memory of an unloaded model back to the OS.

    Its ONNX Runtime sessions free their arenas, but glibc keeps the freed pages
    for later mallocs, and RSS grows with every reload (measured:
    ``loadtest/results/notes.md``, ``loadtest/results/reload_memory.md``). A no-op
    where there is no glibc. What ``freeze_heap`` froze is collectable again first (the
    model may be part of it), and what stays alive is frozen again.
    """
    gc.unfreeze()
    freeze_heap()  # a full collection: the engine's sessions, once nothing refers to them
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` (15 bytes at most) where ``top -H``, ``ps -L`` and
    ``/proc/<pid>/task/<tid>/comm`` show it: Python 3.11's ``threading`` names threads for
    Python only, so the engine threads looked like ONNX Runtime's pool threads ("python").
    Linux only; a no-op elsewhere."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError, TypeError):
        pass


def sched_batch(on: bool) -> str:
    """Put every thread of this process under Linux's SCHED_BATCH if ``on``: the threads and processes
    they start afterwards inherit it (``nmt serve`` calls this once its models are loaded, before it
    starts their engine processes and gRPC). A SCHED_BATCH thread that wakes does not preempt the one
    running; it waits for the tick. With the engine process the server's threads wake each other
    thousands of times a second (gRPC's poller, the driver, the event loop), and each wake-up preempted
    the child: Zen 4, at saturation (``docs/serving.md``), the event loop's context switches 5,100 ->
    1,400 a second, the child's involuntary ones 1,400 -> 260, 1.09x texts/s. In process it made the
    event loop wait behind the spinning pool's workers (0.88x at one text per call): ``auto`` leaves it
    off there. Needs no privilege. What was done, for the start-up log."""
    if not on:
        return "the policy it was started with (--sched-batch off, or auto without an engine process)"
    try:
        for thread in os.listdir("/proc/self/task"):
            os.sched_setscheduler(int(thread), os.SCHED_BATCH, os.sched_param(0))
    except (AttributeError, OSError) as e:  # not Linux, or a seccomp profile that refuses it
        return f"the policy it was started with (SCHED_BATCH refused: {e})"
    return "SCHED_BATCH for every thread and the engine processes (--sched-batch)"
