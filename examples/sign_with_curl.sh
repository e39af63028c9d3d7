#!/usr/bin/env bash
# Sign a gateway control request with plain curl + openssl (CONTRACT §3.2):
#   X-Timestamp = Unix epoch milliseconds; X-Signature = hex HMAC-SHA256(apiHmacKey, timestamp || raw body).
# Usage: KEY='<apiHmacKey>' examples/sign_with_curl.sh POST /v1/rl/tasks/start '{"reward_mode":"terminal"}' \
#          -H 'X-Agent-Session-Id: s1'
set -euo pipefail
method=${1:?method}; path=${2:?path}; body=${3:-}; shift $(( $# < 3 ? $# : 3 ))
gateway=${GATEWAY:-http://127.0.0.1:8080}
ts=$(( $(date +%s%N) / 1000000 ))
sig=$(printf '%s%s' "$ts" "$body" | openssl dgst -sha256 -hmac "${KEY:?set KEY to the apiHmacKey}" -hex | sed 's/^.*= //')
args=(-sS -X "$method" "$gateway$path" -H "X-Timestamp: $ts" -H "X-Signature: $sig" "$@")
if [ -n "$body" ]; then args+=(-H 'Content-Type: application/json' --data-binary "$body"); fi
curl "${args[@]}"
echo
