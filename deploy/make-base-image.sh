#!/usr/bin/env bash
# Builds the base image `pagedserve-base:bookworm` (Debian bookworm, python3 +
# venv, CA certificates) with debootstrap, for hosts that reach a Debian mirror
# but no image registry. Anywhere a registry is reachable, skip this and pass
# e.g. --build-arg BASE_IMAGE=python:3.11-slim-bookworm instead.
#   deploy/make-base-image.sh [TAG] [MIRROR]      (root; needs debootstrap, docker)
set -euo pipefail
TAG=${1:-pagedserve-base:bookworm}
MIRROR=${2:-http://deb.debian.org/debian}
if docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "$TAG already exists"; exit 0
fi
ROOT=$(mktemp -d)
trap 'rm -rf "$ROOT"' EXIT
# minbase: apt and dpkg only; the image adds what the Dockerfile needs.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$ROOT" "$MIRROR"
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/archives/*.deb
tar -C "$ROOT" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' - "$TAG"
echo "built $TAG"
