#!/usr/bin/env bash
# Sign a gateway control request with plain curl + openssl (signature version 2, docs/gateway.md):
#   X-Timestamp = Unix epoch milliseconds; X-Signature-Version = 2;
#   X-Signature = hex HMAC-SHA256(apiHmacKey, "OJRL-HMAC-V2\n" METHOD "\n" PATH?QUERY "\n" timestamp "\n" raw body).
# The signature binds the method, the path and query as sent, and the body: it is good for this request only.
# Usage: KEY='<apiHmacKey>' examples/sign_with_curl.sh POST /v1/rl/tasks/start '{"reward_mode":"terminal"}' \
#          -H 'X-Agent-Session-Id: s1'
#        KEY=... examples/sign_with_curl.sh GET '/v1/rl/tasks?status=active&limit=5'
set -euo pipefail
method=${1:?method}; path=${2:?path}; body=${3:-}; shift $(( $# < 3 ? $# : 3 ))
method=${method^^}
gateway=${GATEWAY:-http://127.0.0.1:8080}
ts=$(( $(date +%s%N) / 1000000 ))
sig=$(printf 'OJRL-HMAC-V2\n%s\n%s\n%s\n%s' "$method" "$path" "$ts" "$body" \
      | openssl dgst -sha256 -hmac "${KEY:?set KEY to the apiHmacKey}" -hex | sed 's/^.*= //')
args=(-sS -X "$method" "$gateway$path" -H "X-Timestamp: $ts" -H "X-Signature-Version: 2" -H "X-Signature: $sig" "$@")
if [ -n "$body" ]; then args+=(-H 'Content-Type: application/json' --data-binary "$body"); fi
curl "${args[@]}"
echo
