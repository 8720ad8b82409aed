#!/usr/bin/env bash
# Runs `docker compose up` for real and uses the stack as a user would:
#   1. builds pagedserve:cpu through docker-compose.yml (layer cache kept),
#   2. brings executor, scheduler and gateway up and waits until all are healthy,
#   3. sends a gRPC request (the pagedserve CLI on the host) and an OpenAI
#      request (curl), reads the scheduler's /metrics,
#   4. checks that the executor serves its socket inside the stack but has no
#      network (nothing on the host or the stack's network can reach it),
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
# Free host ports unless given: other servers on this host may hold the defaults.
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export PAGEDSERVE_GRPC_PORT=${PAGEDSERVE_GRPC_PORT:-$(free_port)}
export PAGEDSERVE_HTTP_PORT=${PAGEDSERVE_HTTP_PORT:-$(free_port)}
export PAGEDSERVE_METRICS_PORT=${PAGEDSERVE_METRICS_PORT:-$(free_port)}

failed() {
    echo "compose-smoke: FAILED at line $1" >&2
    "${COMPOSE[@]}" ps >&2 || true
    "${COMPOSE[@]}" logs --tail 30 >&2 || true
}
trap 'failed $LINENO' ERR
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
text=$("$CLI" --target "127.0.0.1:$PAGEDSERVE_GRPC_PORT" generate "The capital of France is" --max-tokens 8 --temperature 0)
echo "gRPC: $text"
[ -n "$text" ]

# OpenAI from the host: the served model's id, then a completion.
model=$(curl -sf "http://127.0.0.1:$PAGEDSERVE_HTTP_PORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
body=$(curl -sf "http://127.0.0.1:$PAGEDSERVE_HTTP_PORT/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$model\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8, \"temperature\": 0}")
echo "OpenAI: $body"
echo "$body" | python3 -c 'import json,sys; r=json.load(sys.stdin); assert r["choices"][0]["text"] and r["usage"]["completion_tokens"] > 0, r'

# Metrics on the published metrics port.
metrics=$(curl -sf "http://127.0.0.1:$PAGEDSERVE_METRICS_PORT/metrics")  # whole, before grep: no SIGPIPE
grep -Eq '^[a-z_]+:generation_tokens' <<<"$metrics" || { echo "no generation_tokens metric" >&2; exit 1; }
echo "metrics: scheduler /metrics answers on $PAGEDSERVE_METRICS_PORT"

# The executor answers on its socket inside the stack (so the checks below can
# tell), yet has no network: no address, nothing published, and a container on
# the stack's network (the gateway) cannot even resolve its name.
"${COMPOSE[@]}" exec -T scheduler pagedserve --target unix:///run/pagedserve/executor.sock health
executor=$("${COMPOSE[@]}" ps -q executor)
[ "$(docker inspect -f '{{.HostConfig.NetworkMode}}' "$executor")" = none ]
[ -z "$(docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$executor")" ]
[ -z "$(docker port "$executor")" ]
if "${COMPOSE[@]}" exec -T gateway python -c 'import socket; socket.getaddrinfo("executor", 50052)' 2>/dev/null; then
    echo "compose-smoke: FAILED: the executor is reachable on the stack's network" >&2; exit 1
fi
"${COMPOSE[@]}" exec -T gateway python -c 'import socket; socket.getaddrinfo("scheduler", 50051)'  # the check can pass
echo "executor: healthy on its socket inside the stack; no network, no address, nothing published, unknown to the gateway"

phase "stop"
STOP_START=$(date +%s)
"${COMPOSE[@]}" stop
STOPPED=$(date +%s)
"${COMPOSE[@]}" down -v --remove-orphans
echo "compose-smoke: OK in $(( STOPPED - START )) s (build $(( BUILT - START )) s, up to healthy $(( HEALTHY - BUILT )) s, stop $(( STOPPED - STOP_START )) s)"
