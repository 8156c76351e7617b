"""ONNX Runtime sessions: their options (threads, spinning, the shared pool), providers, loading.

Split out of ``service.decoding.runtime``, which imports everything here.
"""

from __future__ import annotations

from typing import Any

import onnxruntime as ort

from service.errors import ModelRepositoryError, ProviderUnavailableError

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}
CUDA_DEVICE_ID = 0
# device 0 (CUDA_DEVICE_ID) is the default: naming it logs a plugin-EP warning per session (ORT 1.31)
CUDA_OPTIONS = {"use_tf32": "0"}


_GLOBAL_POOLS: list[bool] = []  # [True] once this process's environment has global pools


def _global_pools() -> None:
    """Give ONNX Runtime's environment its global pools (ONNX Runtime's default sizes: a thread
    per core), once per process. This cannot be undone: from then on ONNX Runtime refuses a
    session with pools of its own, so every later session of the process runs on them."""
    if not _GLOBAL_POOLS:
        ort.capi._pybind_state.set_global_thread_pool_sizes(0, 0)
        _GLOBAL_POOLS.append(True)


def global_pools() -> bool:
    """Whether this process's sessions run on ONNX Runtime's global pools."""
    return bool(_GLOBAL_POOLS)


def _session_options(intra_op_threads: int | None, *, spinning: bool = False, shared: bool = False
                     ) -> ort.SessionOptions:
    """``shared``: the session runs on the process's global pool (``Runtime``'s ``shared_pool``),
    as every session does once one has (``_global_pools``): ``intra_op_threads`` is then moot."""
    opts = ort.SessionOptions()
    if shared or _GLOBAL_POOLS:
        _global_pools()
        opts.use_per_session_threads = False
    elif intra_op_threads is not None:
        if intra_op_threads < 1:
            raise ValueError(f"intra_op_threads must be >= 1, got {intra_op_threads}")
        opts.intra_op_num_threads = intra_op_threads
    opts.inter_op_num_threads = 1  # the graphs are sequential chains; one pool is enough
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3  # errors only
    # Spinning pool threads wait for the next operator without sleeping. The decoder step is a
    # chain of ~40 small operators run every few milliseconds, so its pool spins by default;
    # the encoder runs rarely and its spinning pool would compete with the decoder's (measured:
    # ``loadtest/results/notes.md``).
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return opts


def provider_list(provider: str) -> list[Any]:
    """ONNX Runtime's providers for ``provider``: CUDA with the CPU for what it lacks, and TF32
    off (as CTranslate2 by default): with it, fp32 products on the GPU's tensor cores round
    inputs to 10 mantissa bits, and 1 greedy translation in 256 differed from the CPU's
    (``loadtest/results/bench_cuda.md``)."""
    if provider not in PROVIDERS:
        raise ValueError(f"provider must be one of {sorted(PROVIDERS)}, got {provider!r}")
    if provider == "cpu":
        return [PROVIDERS["cpu"]]
    return [(PROVIDERS["cuda"], CUDA_OPTIONS), PROVIDERS["cpu"]]


def _check_provider(provider: str) -> list[Any]:
    if provider == "cuda" and PROVIDERS["cuda"] not in ort.get_available_providers():
        raise ProviderUnavailableError(
            "provider 'cuda' needs the onnxruntime-gpu package (pip install 'nmt-serve[gpu]'); "
            f"this onnxruntime offers {ort.get_available_providers()}")
    return provider_list(provider)


def _load_session(path: str, options: ort.SessionOptions, providers: list[Any],
                  inputs: dict, outputs: dict, *, model: bytes | None = None) -> ort.InferenceSession:
    """A session whose input and output names are the contract's, or ModelRepositoryError
    (``model``: the graph of ``path`` as converted in memory)."""
    try:
        session = ort.InferenceSession(path if model is None else model, sess_options=options,
                                       providers=providers)
    except Exception as e:  # onnxruntime raises several private exception types
        raise ModelRepositoryError(f"{path}: cannot be loaded by ONNX Runtime ({str(e)[:200]})") from None
    have_in = {i.name for i in session.get_inputs()}
    have_out = {o.name for o in session.get_outputs()}
    if have_in != set(inputs) or not set(outputs) <= have_out:
        raise ModelRepositoryError(
            f"{path}: graph inputs {sorted(have_in)} / outputs {sorted(have_out)} do not match "
            f"the contract {sorted(inputs)} / {sorted(outputs)}")
    return session


def run_bound(session: ort.InferenceSession, host: dict, device: dict, outputs: list[str], *,
              on_device: set[str]) -> list[Any]:
    """Run ``session`` with I/O binding (CUDA): ``host`` inputs from numpy, ``device`` inputs
    as OrtValues already there; the ``outputs`` in ``on_device`` stay on the device."""
    binding = session.io_binding()
    for name, value in host.items():
        binding.bind_cpu_input(name, value)
    for name, value in device.items():
        binding.bind_ortvalue_input(name, value)
    for name in outputs:
        binding.bind_output(name, "cuda" if name in on_device else "cpu", CUDA_DEVICE_ID if name in on_device else 0)
    session.run_with_iobinding(binding)
    return binding.get_outputs()


def session_shapes(session: ort.InferenceSession) -> dict[str, list[int | str | None]]:
    """A session's inputs and outputs, name -> shape (sizes and axis names)."""
    return {a.name: list(a.shape) for a in [*session.get_inputs(), *session.get_outputs()]}
