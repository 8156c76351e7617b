# nmt-serve serving image: service/ on ONNX Runtime with the shipped models inside
# (models/: en-fr, en-de, en-es, fr-en, each its one served version; en-fr is the default).
# No torch, no export/: the wheel is built from service/ alone.
#
#   docker build -t nmt-serve .                                   # CPU (make image)
#   docker run --rm --read-only -p 50051:50051 -p 9464:9464 -p 8080:8080 nmt-serve   # page: http://localhost:8080/
#   docker run --rm -e NMT_PRECISION=int8 -e NMT_MAX_ROWS=64 ... nmt-serve
#
# Configuration: NMT_* environment variables, one per `nmt serve` flag
# (`docker run --rm nmt-serve --help` lists them). A bad value or a missing
# model directory stops the container at once with a one-line reason.
#
# GPU variant (linted, documented, not built on the CI machines, where no CUDA
# base image can be pulled): the same stages on a CUDA runtime base, with
# onnxruntime-gpu in place of onnxruntime.
#   docker build -t nmt-serve:gpu \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-cudnn-runtime-ubuntu24.04 \
#     --build-arg ONNXRUNTIME=onnxruntime-gpu .
#   docker run --rm --gpus all -e NMT_PROVIDER=cuda -p 50051:50051 nmt-serve:gpu
#
# Classic-builder compatible: no syntax line, no heredocs, no COPY --link.

ARG BASE_IMAGE=python:3.11-slim

# ---- builder: a virtual environment holding service/ and its runtime dependencies ----
FROM ${BASE_IMAGE} AS builder
ARG ONNXRUNTIME=onnxruntime
ARG MODEL_REPOSITORY=models
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# A CUDA runtime base has no Python; python:3.11-slim has it and skips this.
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
 && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# setup.py compiles the fused kernels (service/decoding/*.c: attention, query, middle, output layers, encoder and
# its rest, shortlist words): a C compiler and
# Python's headers in this stage only (the serve stage gets the built module, no compiler).
# hadolint ignore=DL3008
RUN need=""; command -v cc >/dev/null || need="gcc libc6-dev"; \
    [ -f "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ] || need="$need python3-dev"; \
    if [ -n "$need" ]; then \
        apt-get update && apt-get install -y --no-install-recommends $need && rm -rf /var/lib/apt/lists/*; \
    fi
COPY pyproject.toml setup.py README.md* ./
COPY service/ service/
# Both ONNX Runtime wheels install the `onnxruntime` module: the GPU one must be
# the only one. The checks run isolated (-I) so /src/service cannot stand in for the
# installed package. pip and setuptools leave the venv: nothing installs at run time.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir . \
 && if [ "$ONNXRUNTIME" != onnxruntime ]; then \
        pip uninstall -y onnxruntime && pip install --no-cache-dir "$ONNXRUNTIME"; \
    fi \
 && python -I -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) for m in ('torch', 'export')))" \
 && python -I -c "import service.api.grpc_server, onnxruntime; print('onnxruntime', onnxruntime.__version__)" \
 && python -I -c "from service.decoding import _attention" \
 && python -I -c "from service.api.http_server import WEB; assert (WEB / 'index.html').is_file(), WEB" \
 && pip uninstall -y pip setuptools
# A model repository: one version directory (<name>/<version>/, with its
# manifest.json) or a directory of <name>/<version>/ directories, all served.
# Exported model directories can be mode 0700: make them readable by the
# non-root user here, so the runtime stage copies them in one layer.
COPY ${MODEL_REPOSITORY}/ /opt/nmt/models/
COPY deploy/healthcheck.py /opt/nmt/healthcheck.py
RUN find /opt/nmt/models -maxdepth 3 -name manifest.json | grep -q . \
 && chmod -R a+rX,go-w /opt/nmt /opt/venv

# ---- serve: the runtime image ----
FROM ${BASE_IMAGE} AS serve
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --gid 10001 nmt \
 && useradd --uid 10001 --gid nmt --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin nmt
COPY --from=builder /opt/venv /opt/venv
COPY --from=builder /opt/nmt /opt/nmt
# Bytecode was compiled at install time; nothing is written at run time, so a
# read-only root filesystem works (no volume, no tmpfs needed). ONNX Runtime's
# telemetry is off: a server has no business calling home, and it would try to
# persist a device id under $HOME (a warning on every start, read-only or not).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    ORT_DISABLE_TELEMETRY=1 \
    NMT_MODEL_REPOSITORY=/opt/nmt/models \
    NMT_DEFAULT_MODEL=en-fr \
    NMT_HOST=0.0.0.0 \
    NMT_PORT=50051 \
    NMT_METRICS_PORT=9464 \
    NMT_HTTP_PORT=8080
WORKDIR /opt/nmt
# Numeric, so Kubernetes' runAsNonRoot can check it.
USER 10001:10001
EXPOSE 50051 9464 8080
# The server drains on SIGTERM: NOT_SERVING, refuse new calls, finish in-flight
# ones within NMT_GRACE_PERIOD seconds, exit 0. Give `docker stop -t` more than that.
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["python", "/opt/nmt/healthcheck.py"]
ENTRYPOINT ["nmt", "serve"]
