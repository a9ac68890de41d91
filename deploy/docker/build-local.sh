#!/usr/bin/env bash
# Build and smoke-test the CPU image with Debian's own tools and no image registry: mmdebstrap makes
# the base (Debian bookworm: python3, venv) from Debian's archive, podman imports it, buildah builds
# deploy/docker/cpu.Dockerfile on it (torch's CPU wheel from PyPI), podman runs it and a chat
# request must be answered.
#   deploy/docker/build-local.sh [workdir]        (apt-get install buildah podman mmdebstrap uidmap)
# Exit status: 0 built and answered; 1 a step failed (its output says which and why).
set -euo pipefail
WORK="${1:-$(mktemp -d)}"
PORT="${PORT:-18080}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
cd "$(dirname "$0")/../.."
step() { echo "== $*"; }

if [ ! -s "$WORK/base.tar" ]; then  # a workdir that holds one reuses it
  step "base: mmdebstrap bookworm"
  mmdebstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$WORK/base.tar"
fi
step "base: podman import"
podman import "$WORK/base.tar" localhost/ballast-base:bookworm
# A host whose HTTPS goes through an intercepting proxy trusts its CA in the system bundle; the
# build's pip (inside the Debian base, whose own bundle lacks that CA) gets the same bundle,
# read-only, through a site-wide pip.conf (buildah 1.28 does not pass --env to RUN steps).
CA_BUNDLE="${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}"
ca_args=()
if [ -s "$CA_BUNDLE" ]; then
  printf '[global]\ncert = /etc/ssl/host-ca.crt\n' > "$WORK/pip.conf"
  ca_args=(--volume "$CA_BUNDLE:/etc/ssl/host-ca.crt:ro" --volume "$WORK/pip.conf:/etc/pip.conf:ro")
fi
step "image: buildah build"
buildah build --isolation chroot --layers=false "${ca_args[@]}" -f deploy/docker/cpu.Dockerfile \
  --build-arg PYTHON_IMAGE=localhost/ballast-base:bookworm \
  --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
  --build-arg TORCH_VERSION="$TORCH_VERSION" \
  -t localhost/ballast:cpu .
step "run: podman run"
podman run -d --rm --name ballast-smoke -p "127.0.0.1:$PORT:8000" --memory 4g localhost/ballast:cpu
trap 'podman rm -f ballast-smoke >/dev/null 2>&1 || true' EXIT
for _ in $(seq 1 180); do
  curl -sf "http://127.0.0.1:$PORT/ready" > /dev/null && break
  sleep 1
done
step "chat"
curl -sf "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' \
  -d '{"model": "default", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}'
echo
