# syntax=docker/dockerfile:1
#
# Tandem engine image: the tandem-serve package with torch. Build from the repository root.
#
# CPU (default): torch comes from the PyTorch CPU wheel index, so no CUDA libraries ship.
#
#   docker build -f docker/engine.Dockerfile -t tandem/engine:0.1.0 .
#
# CUDA: PyTorch's CUDA wheels bundle the CUDA runtime, cuDNN and NCCL, so the default Python
# base is enough; the node supplies only the NVIDIA driver (NVIDIA container toolkit or GPU
# operator). Pick the wheel index matching the CUDA version the node driver supports:
#
#   docker build -f docker/engine.Dockerfile \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     -t tandem/engine:0.1.0-cuda .
#
# or on an NVIDIA CUDA base image (its system Python is used; Ubuntu 24.04 has 3.12):
#
#   docker build -f docker/engine.Dockerfile \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     -t tandem/engine:0.1.0-cuda .
#
# Then deploy with the Helm chart: --set engine.device=cuda --set engine.image.tag=0.1.0-cuda

ARG BASE_IMAGE=python:3.11-slim
ARG BUILDER_IMAGE=python:3.11-slim

# --- wheel: build the pure-Python tandem-serve wheel; nothing of this stage ships. ---
FROM ${BUILDER_IMAGE} AS wheel
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# --- runtime-base: BASE_IMAGE with a Python 3 (CUDA bases have none) and the service user. ---
FROM ${BASE_IMAGE} AS runtime-base
RUN set -eux; \
    if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    groupadd --system --gid 10001 tandem; \
    useradd --system --uid 10001 --gid 10001 --home-dir /home/tandem --create-home \
        --shell /usr/sbin/nologin tandem

# --- venv: torch first from its own index, then the wheel and its remaining dependencies. ---
FROM runtime-base AS venv
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_REQUIREMENT="torch>=2.4,<2.14"
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "${TORCH_REQUIREMENT}"
# torch is already satisfied, so pip takes only the other dependencies from PyPI.
RUN --mount=type=bind,from=wheel,source=/dist,target=/dist \
    pip install --no-cache-dir /dist/*.whl \
    && tandem-engine --help >/dev/null
# Prebuild the native kernels (engine_svc/model/native) for every CPU kind they dispatch on
# (AVX2, AVX512, AVX512-BF16), so the final image needs no compiler: an engine loads the build
# its CPU runs; on a CPU without AVX2 it keeps the plain-PyTorch path.
RUN set -eux; \
    apt-get update; \
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev; \
    rm -rf /var/lib/apt/lists/*; \
    TANDEM_KERNEL_DIR=/opt/tandem/kernels python3 -c \
        "from engine_svc.model.native import build; from engine_svc.model.native.cpu import ISA_BUILDS; [build(i) for i in ISA_BUILDS]"

# --- final: the venv on the runtime base; no compilers, no sources, no wheel files. ---
FROM runtime-base
COPY --from=venv /opt/venv /opt/venv
COPY --from=venv /opt/tandem/kernels /opt/tandem/kernels
COPY --chmod=0755 docker/tandem-health-probe /usr/local/bin/tandem-health-probe
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/tandem \
    TANDEM_KERNEL_DIR=/opt/tandem/kernels
USER 10001:10001
WORKDIR /home/tandem
# gRPC (EngineService, health, reflection) and Prometheus metrics.
EXPOSE 50051 9090
# No HEALTHCHECK: Kubernetes probes the gRPC health service (see helm/tandem).
ENTRYPOINT ["tandem-engine"]
CMD ["--host", "0.0.0.0", "--metrics-port", "9090"]
