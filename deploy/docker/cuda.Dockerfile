# ballast on NVIDIA GPUs. From the repository root:
#   docker build -f deploy/docker/cuda.Dockerfile -t ballast:cuda .
#   docker run --rm --gpus 1 -p 8000:8000 --memory 32g ballast:cuda
# torch's CUDA wheel brings its own CUDA libraries; the base image pins the user-space CUDA the
# driver is checked against (the host driver must support CUDA 12.8). Pin the digest too in your
# registry (docker buildx imagetools inspect nvidia/cuda:12.8.1-base-ubuntu24.04).

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04

FROM ${CUDA_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 BALLAST_CACHE_DIR=/opt/ballast/models DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/ballast/venv
ENV PATH=/opt/ballast/venv/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ballast ballast
COPY memory memory
COPY models models
COPY engine engine
COPY scheduler scheduler
COPY server server
COPY bench bench
# fla: flash-linear-attention's Triton kernels for hybrid models' prefill. The project itself is
# what is installed here, so there is no version to pin.
# hadolint ignore=DL3013
RUN pip install ".[fla]" \
    && python -P -c "from ballast.models.default_model import default_model_path; print(default_model_path())" \
    && ballast serve --help > /dev/null

FROM ${CUDA_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
# Triton builds a small C launcher for each kernel at run time: it needs a C compiler and
# Python's headers in the image.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 ballast \
    && useradd --system --uid 10001 --gid ballast --home-dir /tmp --no-create-home --shell /usr/sbin/nologin ballast
COPY --from=build /opt/ballast /opt/ballast
ENV PATH=/opt/ballast/venv/bin:$PATH \
    BALLAST_CACHE_DIR=/opt/ballast/models \
    BALLAST_HOST=0.0.0.0 \
    BALLAST_PORT=8000 \
    BALLAST_DEVICE=cuda \
    HOME=/tmp \
    PYTHONUNBUFFERED=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-c", "import os, sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('BALLAST_PORT', '8000') + '/health', timeout=4).status != 200)"]
ENTRYPOINT ["ballast"]
CMD ["serve", "--model", "default"]
