# syntax=docker/dockerfile:1
#
# Shoal's images, one multi-stage build (context: the repository root):
#
#   docker build --target operator -t ghcr.io/shoal-dev/shoal-operator:0.1.0 .  # kopf, no torch
#   docker build --target router   -t ghcr.io/shoal-dev/shoal-router:0.1.0 .    # slim, no torch
#   docker build --target engine   -t ghcr.io/shoal-dev/shoal:0.1.0 .           # CPU torch
#
# The engine image runs engine ranks (`shoal serve`); it is the InferenceEngine's default
# `spec.image`. The router image runs the per-engine frontends (`shoal router`) and the fleet
# gateway (`shoal gateway`): HTTP only, no torch, no model; and the model fetcher (`shoal fetch`,
# huggingface_hub), the init container of an engine pod whose model is hf://.
#
# The CUDA engine image is images/engine-cuda/Dockerfile. Both targets run as uid 10001 with
# tini as PID 1: tini forwards SIGTERM to the whole process group (the engine's frontend,
# EngineCore and workers drain on it) and exits with the engine's own exit code (128+N for a
# signal), so Kubernetes records why the engine stopped.

ARG PYTHON_IMAGE=python:3.11.7-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# ---- base: Python, tini, the unprivileged user; shared by every target --------------------
FROM ${PYTHON_IMAGE} AS base
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 shoal \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin shoal
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/shoal/bin:$PATH
COPY images/healthcheck.py /usr/local/lib/shoal/healthcheck.py

# ---- wheel: the shoal package, built once, installed by both targets -----------------------
FROM base AS wheel
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY contract/ contract/
COPY engine/ engine/
COPY router/ router/
COPY operator/ operator/
COPY fetch/ fetch/
COPY cli/ cli/
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---- operator: kopf + kubernetes client, never torch -----------------------------------------
FROM base AS operator-venv
COPY --from=wheel /wheels /wheels
RUN python -m venv /opt/shoal \
 && /opt/shoal/bin/pip install "$(ls /wheels/shoal-*.whl)[operator]" \
 && ! /opt/shoal/bin/python -c "import torch" 2>/dev/null

FROM base AS operator
COPY --from=operator-venv /opt/shoal /opt/shoal
USER 10001:10001
EXPOSE 8080
# kopf's liveness endpoint, when the operator was started with --liveness (the default here).
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "/usr/local/lib/shoal/healthcheck.py"]
ENTRYPOINT ["tini", "-g", "--", "shoal-operator"]
CMD ["--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz"]

# ---- router: `shoal router` and `shoal gateway`, never torch --------------------------------
FROM base AS router-venv
COPY --from=wheel /wheels /wheels
RUN python -m venv /opt/shoal \
 && /opt/shoal/bin/pip install "$(ls /wheels/shoal-*.whl)[router]" \
 && ! /opt/shoal/bin/python -c "import torch" 2>/dev/null

# Shoal's supervisor for stock vLLM pods (shoal.contract.supervisor.BUNDLE_IN_IMAGE): a zipapp of
# shoal.supervisor + shoal.contract (standard library only) that an engine pod's init container
# copies out for the vLLM image's own python3.
COPY contract/ /src/contract/
COPY supervisor/ /src/supervisor/
RUN PYTHONPATH=/src/contract:/src/supervisor python -m shoal.supervisor.bundle \
      /opt/shoal-supervisor/shoal-supervisor.pyz \
 && python -I -S -c "import sys; sys.path.insert(0, '/opt/shoal-supervisor/shoal-supervisor.pyz'); \
      import shoal.supervisor.supervise, shoal.supervisor.bundle"

FROM base AS router
COPY --from=router-venv /opt/shoal /opt/shoal
COPY --from=router-venv /opt/shoal-supervisor /opt/shoal-supervisor
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
  CMD ["python", "/usr/local/lib/shoal/healthcheck.py"]
ENTRYPOINT ["tini", "-g", "--", "shoal"]
CMD ["--help"]

# ---- engine: `shoal serve` on CPU torch ------------------------------------------------------
FROM base AS engine-venv
ARG TORCH_VERSION
ARG TORCH_INDEX_URL
# torch first, from the CPU index: the engine extra then finds torch==2.13.0 satisfied and
# never pulls a CUDA build. Its own layer, before the wheel: a source change reuses it.
RUN python -m venv /opt/shoal \
 && /opt/shoal/bin/pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY --from=wheel /wheels /wheels
RUN /opt/shoal/bin/pip install "$(ls /wheels/shoal-*.whl)[engine]"

FROM base AS engine
# A C compiler for the CPU paged-decode kernel (docs/engine.md): the engine builds it on its first
# start into $HOME/.cache/shoal/kernels (about a second); without one it logs why and uses the
# slower torch decode path.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=engine-venv /opt/shoal /opt/shoal
# Writable places on a read-only root filesystem: mount an emptyDir at /tmp.
ENV HOME=/tmp HF_HOME=/tmp/hf TRANSFORMERS_OFFLINE=1 HF_HUB_OFFLINE=1
WORKDIR /tmp
USER 10001:10001
EXPOSE 8000
# GET /health on the HTTP port; headless ranks (--headless) have no HTTP server and pass.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "/usr/local/lib/shoal/healthcheck.py"]
ENTRYPOINT ["tini", "-g", "--", "shoal"]
CMD ["--help"]
