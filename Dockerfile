# One image, two commands: `python -m executor_svc` and `python -m scheduler_svc`.
# Installs with `make install`, the same step a developer runs (one source of truth).
FROM python:3.11-slim

RUN apt-get update && apt-get install -y --no-install-recommends make gcc && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
# CPU torch by default; the GPU override rebuilds with TORCH_PIP_ARGS="" (CUDA wheels from PyPI).
ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
RUN make install TORCH_PIP_ARGS="${TORCH_PIP_ARGS}" PYTHON=python3
ENV PATH="/app/.venv/bin:${PATH}" PYTHONUNBUFFERED=1 PAGEDSERVE_LOG_JSON=1
EXPOSE 50051
CMD ["python", "-m", "scheduler_svc"]
