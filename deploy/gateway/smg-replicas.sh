#!/usr/bin/env bash
# N ballast replicas on this host behind SGLang's gateway (smg), no container engine needed.
#   deploy/gateway/smg-replicas.sh [N] [first replica port] [gateway port]      (defaults: 3 8001 8000)
# Extra `ballast serve` arguments come from BALLAST_ARGS (e.g. "--max-num-seqs 16"); every
# BALLAST_* variable applies to every replica. Ctrl-C stops the gateway and every replica.
#
# The gateway probes each replica's /ready every second (a replica at CRITICAL leaves the rotation
# at the next probe and rejoins when it recovers), polls its /metrics every second for load
# (vllm:num_requests_running / _waiting and vllm:kv_cache_usage_perc, which ballast measures against
# what its memory allows now), routes with cache-aware affinity (a chat's later turns go where its
# prefix is cached), and retries a refused (503/429) or failed request on another replica.
set -euo pipefail
N="${1:-3}"
FIRST_PORT="${2:-8001}"
GATEWAY_PORT="${3:-8000}"
HOST="${HOST:-127.0.0.1}"
MODEL="${MODEL:-default}"
# smg registers each worker under the first id of its /v1/models: give every replica the one name
# clients send.
SERVED_NAME="${SERVED_NAME:-default}"
BALLAST="${BALLAST:-ballast}"
SMG="${SMG:-smg}"
read -r -a EXTRA <<< "${BALLAST_ARGS:-}"

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait; }
trap cleanup EXIT INT TERM

urls=()
for ((i = 0; i < N; i++)); do
  port=$((FIRST_PORT + i))
  "$BALLAST" serve --host "$HOST" --port "$port" --model "$MODEL" --served-model-name "$SERVED_NAME" \
    "${EXTRA[@]}" &
  pids+=("$!")
  urls+=("http://$HOST:$port")
done

for url in "${urls[@]}"; do  # smg would register a replica that is still loading as unhealthy
  until curl -sf "$url/ready" > /dev/null; do sleep 1; done
  echo "ready: $url"
done

"$SMG" launch --host "$HOST" --port "$GATEWAY_PORT" --worker-urls "${urls[@]}" \
  --policy cache_aware \
  --cache-threshold 0.1 \
  --health-check-endpoint /ready --health-check-interval-secs 1 \
  --health-failure-threshold 1 --health-success-threshold 1 \
  --load-monitor-interval 1 \
  --worker-wedge-secs 60 &  # a CPU replica's queued request may wait seconds for its first token
pids+=("$!")
echo "gateway: http://$HOST:$GATEWAY_PORT/v1 (model \"$SERVED_NAME\")"
wait -n
