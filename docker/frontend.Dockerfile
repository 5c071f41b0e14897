# syntax=docker/dockerfile:1
#
# Tandem frontend image: the tandem-serve package WITHOUT torch. Build from the repository root.
#
#   docker build -f docker/frontend.Dockerfile -t tandem/frontend:0.1.0 .
#
# The project ships one distribution, tandem-serve, whose dependencies include torch because
# the engine needs it. The frontend never imports torch, so this image installs the wheel with
# --no-deps and then docker/frontend-requirements.txt: the package's dependency list minus
# torch (and grpcio-tools, used only to regenerate protobuf code). tests/helm/test_images.py
# keeps that file in step with pyproject.toml. The result is a few hundred MB instead of
# several GB.

ARG BASE_IMAGE=python:3.11-slim
ARG BUILDER_IMAGE=python:3.11-slim

# --- wheel: build the pure-Python tandem-serve wheel; nothing of this stage ships. ---
FROM ${BUILDER_IMAGE} AS wheel
WORKDIR /src
COPY . .
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

# --- runtime-base: the Python base and the service user. ---
FROM ${BASE_IMAGE} AS runtime-base
RUN groupadd --system --gid 10001 tandem \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/tandem --create-home \
        --shell /usr/sbin/nologin tandem

# --- venv: the wheel without its dependencies, then the explicit torch-free list. ---
FROM runtime-base AS venv
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY docker/frontend-requirements.txt /tmp/frontend-requirements.txt
RUN --mount=type=bind,from=wheel,source=/dist,target=/dist \
    pip install --no-cache-dir --no-deps /dist/*.whl \
    && pip install --no-cache-dir -r /tmp/frontend-requirements.txt \
    && tandem-frontend --help >/dev/null \
    && if python -c "import torch" 2>/dev/null; then echo "torch must not be in the frontend image" >&2; exit 1; fi

# --- final: the venv on the runtime base; no compilers, no sources, no wheel files. ---
FROM runtime-base
COPY --from=venv /opt/venv /opt/venv
COPY --chmod=0755 docker/tandem-health-probe /usr/local/bin/tandem-health-probe
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/tandem
USER 10001:10001
WORKDIR /home/tandem
# gRPC (GenerateService, health, reflection) and Prometheus metrics.
EXPOSE 50050 9091
# No HEALTHCHECK: Kubernetes probes the gRPC health service (see helm/tandem).
ENTRYPOINT ["tandem-frontend"]
# Point it at engines: docker run tandem/frontend:0.1.0 --host 0.0.0.0 --engine HOST:50051
CMD ["--host", "0.0.0.0", "--metrics-port", "9091"]
