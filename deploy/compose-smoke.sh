#!/usr/bin/env bash
# Runs `docker compose up` for real and uses the stack as a user would:
#   1. builds pagedserve:cpu through docker-compose.yml (layer cache kept),
#   2. brings executor, scheduler and gateway up and waits until all are healthy,
#   3. sends a gRPC request (the pagedserve CLI on the host) and an OpenAI
#      request (curl), reads the scheduler's /metrics,
#   4. checks that the executor serves its socket inside the stack but is
#      unreachable from the host,
#   5. stops the stack and prints each phase's duration.
#
#   deploy/compose-smoke.sh        (root or the docker group; from any directory)
#
# Environment: PAGEDSERVE_CLI (default .venv/bin/pagedserve, else `pagedserve`),
# PAGEDSERVE_BASE_IMAGE (default: pagedserve-base:bookworm, made with
# deploy/make-base-image.sh when missing), PAGEDSERVE_TORCH_WHEEL (a local torch
# wheel for the image; default: the host's torch==2.13.0+cpu wheel).
# Builds use host networking and the host's extra CA certificates, for hosts
# whose only way out is the host's own (possibly TLS-inspecting) egress.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
PROJECT=pagedserve-smoke
phase() { echo "--- compose-smoke: $* ($(( $(date +%s) - START )) s)"; }

if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); else COMPOSE=(docker-compose); fi
COMPOSE+=(-p "$PROJECT" -f docker-compose.yml)
CLI=${PAGEDSERVE_CLI:-$( [ -x .venv/bin/pagedserve ] && echo .venv/bin/pagedserve || echo pagedserve )}

export PAGEDSERVE_BASE_IMAGE=${PAGEDSERVE_BASE_IMAGE:-pagedserve-base:bookworm}
if [ "$PAGEDSERVE_BASE_IMAGE" = pagedserve-base:bookworm ]; then deploy/make-base-image.sh; fi

# The image's torch is the host's local CPU wheel, staged for the build stage only.
WHEEL=${PAGEDSERVE_TORCH_WHEEL:-$(find /opt/wheels "${HOME}/.cache/pip" -name 'torch-2.13.0+cpu-*.whl' 2>/dev/null | head -1 || true)}
[ -f "$WHEEL" ] || { echo "no local torch wheel (set PAGEDSERVE_TORCH_WHEEL)" >&2; exit 2; }
rm -f deploy/local/*.whl deploy/local/*.crt
ln -f "$WHEEL" deploy/local/ 2>/dev/null || cp "$WHEEL" deploy/local/
cp /usr/local/share/ca-certificates/*.crt deploy/local/ 2>/dev/null || true
TORCH_VERSION=$(basename "$WHEEL" | cut -d- -f2)
export PAGEDSERVE_TORCH_SPEC="torch==$TORCH_VERSION" PAGEDSERVE_TORCH_PIP_ARGS="" PAGEDSERVE_BUILD_NETWORK=host
export PAGEDSERVE_METRICS_PORT=${PAGEDSERVE_METRICS_PORT:-9090}

cleanup() { "${COMPOSE[@]}" down -v --remove-orphans >/dev/null 2>&1 || true; rm -f deploy/local/*.whl deploy/local/*.crt; }
trap cleanup EXIT

phase "build"
"${COMPOSE[@]}" build
BUILT=$(date +%s)
phase "up"
"${COMPOSE[@]}" up -d
health() { docker inspect -f '{{.State.Health.Status}}' "$("${COMPOSE[@]}" ps -q "$1")" 2>/dev/null || echo missing; }
deadline=$(( $(date +%s) + 300 ))
until [ "$(health executor)/$(health scheduler)/$(health gateway)" = healthy/healthy/healthy ]; do
    if [ "$(date +%s)" -gt "$deadline" ]; then
        "${COMPOSE[@]}" ps; "${COMPOSE[@]}" logs --tail 40
        echo "compose-smoke: FAILED: not healthy after 300 s" >&2; exit 1
    fi
    sleep 2
done
HEALTHY=$(date +%s)
phase "all three healthy after $(( HEALTHY - BUILT )) s"

# gRPC from the host, through the published scheduler port.
text=$("$CLI" --target 127.0.0.1:50051 generate "The capital of France is" --max-tokens 8 --temperature 0)
echo "gRPC: $text"
[ -n "$text" ]

# OpenAI from the host: the served model's id, then a completion.
model=$(curl -sf http://127.0.0.1:8000/v1/models | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
body=$(curl -sf http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0}")
echo "OpenAI: $body"
echo "$body" | python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["choices"][0]["text"] and r["usage"]["completion_tokens"] > 0, r'

# Metrics on the published metrics port.
curl -sf "http://127.0.0.1:$PAGEDSERVE_METRICS_PORT/metrics" | grep -Eq '^[a-z_]+:generation_tokens' || { echo "no generation_tokens metric" >&2; exit 1; }
echo "metrics: scheduler /metrics answers on $PAGEDSERVE_METRICS_PORT"

# The executor answers on its socket inside the stack (so the check below can
# tell), has no network and publishes nothing, and the host cannot reach it.
"${COMPOSE[@]}" exec -T scheduler pagedserve --target unix:///run/pagedserve/executor.sock health
executor=$("${COMPOSE[@]}" ps -q executor)
[ "$(docker inspect -f '{{.HostConfig.NetworkMode}}' "$executor")" = none ]
[ "$(docker port "$executor" | wc -l)" -eq 0 ]
if "$CLI" --target 127.0.0.1:50052 health --timeout 2 >/dev/null 2>&1; then
    echo "compose-smoke: FAILED: an executor answers on the host's 127.0.0.1:50052" >&2; exit 1
fi
echo "executor: healthy on its socket inside the stack; network none, nothing published, host cannot reach it"

phase "stop"
STOP_START=$(date +%s)
"${COMPOSE[@]}" stop
STOPPED=$(date +%s)
"${COMPOSE[@]}" down -v --remove-orphans
echo "compose-smoke: OK in $(( STOPPED - START )) s (build $(( BUILT - START )) s, up to healthy $(( HEALTHY - BUILT )) s, stop $(( STOPPED - STOP_START )) s)"
