# syntax=docker/dockerfile:1
# The pdserve image. One image runs every pdserve container the Helm chart (helm/pdserve)
# creates: the Ray head, the router (`pdserve serve`), the prefill and decode Ray workers, and
# the `helm test` pod.
#
#   CPU:   docker build -t REGISTRY/pdserve:0.1.0 .
#   CUDA:  docker build --build-arg TORCH_VARIANT=cu128 -t REGISTRY/pdserve:0.1.0-cu128 .
#
# The CUDA variant needs no CUDA base image: torch's CUDA wheels bring the CUDA runtime, cuBLAS,
# cuDNN and NCCL as pip packages; GPU nodes need only the NVIDIA driver and device plugin.

ARG PYTHON_VERSION=3.11
FROM python:${PYTHON_VERSION}-slim

# torch build: "cpu", or a CUDA variant published on download.pytorch.org (cu126, cu128, ...).
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
# Must equal the chart's rayCluster.rayVersion: KubeRay and every Ray node must agree on it.
ARG RAY_VERSION=2.60.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PDSERVE_CACHE_DIR=/opt/pdserve/cache

# wget: KubeRay's default health probes of Ray containers run `wget` against the Ray dashboard
# agent. (bash, which KubeRay's generated `ray start` command line needs, is in the base image.)
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/*

# torch first, from its own index, so `pip install .` finds it satisfied and never pulls the
# default (CUDA-bundling) build from PyPI.
RUN pip install --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}" "torch==${TORCH_VERSION}"

COPY . /src
# A C compiler only while pdserve installs: it builds the router's block hashing in C
# (pdserve/core/_block_chain.c; the import checks it was built), then leaves the image.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && pip install /src "ray[default]==${RAY_VERSION}" \
 && python -c "import pdserve.core._block_chain" \
 && apt-get purge -y --auto-remove gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* /src

# The built-in tiny model (deterministic random weights; used when the chart sets no model).
# The router resolves its path and hands that path to the workers on other pods, so it must
# exist at the same place in every container: bake it into the image, read-only.
RUN python -c "from pdserve.models.builtin import default_model_dir; print(default_model_dir())" \
 && chmod -R a+rX /opt/pdserve

# Non-root; numeric so Kubernetes can verify runAsNonRoot. The chart's pods run as 1000:1000.
RUN useradd --create-home --uid 1000 --user-group pdserve
USER 1000:1000
WORKDIR /home/pdserve

# 50051: the router's gRPC API; 9090: its Prometheus metrics (the chart's defaults).
EXPOSE 50051 9090
ENTRYPOINT ["pdserve"]
CMD ["serve"]
