# SGLang's gateway (smg, a Rust binary on PyPI) for deploy/k8s/gateway/smg. From the repository root:
#   docker build -f deploy/docker/smg.Dockerfile -t ballast-gateway:smg .
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
FROM ${PYTHON_IMAGE}
ARG SMG_VERSION=1.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install "smg==${SMG_VERSION}" \
    && groupadd --system --gid 10001 smg \
    && useradd --system --uid 10001 --gid smg --home-dir /tmp --no-create-home --shell /usr/sbin/nologin smg
USER 10001:10001
EXPOSE 8000 29000
ENTRYPOINT ["smg"]
CMD ["launch", "--help"]
