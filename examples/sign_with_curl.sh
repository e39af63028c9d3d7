#!/usr/bin/env bash
# Sign a gateway control request with plain curl + openssl (signature version 3, docs/gateway.md):
#   X-Timestamp = Unix epoch milliseconds; X-Signature-Version = 3; X-Key-Id = the agent key's id (agent keys only);
#   X-Signature = hex HMAC-SHA256(key, "OJRL-HMAC-V3\n" METHOD "\n" PATH?QUERY "\n" timestamp "\n" KEY_ID "\n"
#                                       SESSION "\n" raw body).
# The signature binds the method, the path and query as sent, the key id, the X-Agent-Session-Id header and the body:
# it is good for this request only. Set SESSION to send (and sign) an X-Agent-Session-Id; a session header passed as
# an extra curl argument is not signed and the gateway refuses it. A key of 64 hex digits is used as the 32 bytes it
# encodes, any other key as its UTF-8 bytes (as the gateway does).
# Usage: KEY='<apiHmacKey>' examples/sign_with_curl.sh GET '/v1/rl/tasks?status=active&limit=5'
#        KEY='<agentHmacKey>' KEY_ID=support-bot SESSION=s1 \
#          examples/sign_with_curl.sh POST /v1/rl/tasks/start '{"reward_mode":"terminal"}'
set -euo pipefail
method=${1:?method}; path=${2:?path}; body=${3:-}; shift $(( $# < 3 ? $# : 3 ))
method=${method^^}
gateway=${GATEWAY:-http://127.0.0.1:8080}
key=${KEY:?set KEY to the apiHmacKey, or to an agentHmacKey with KEY_ID}
key_id=${KEY_ID:-}; session=${SESSION:-}
ts=$(( $(date +%s%N) / 1000000 ))
if [[ $key =~ ^[0-9a-fA-F]{64}$ ]]; then mac=(-mac HMAC -macopt "hexkey:$key"); else mac=(-hmac "$key"); fi
sig=$(printf 'OJRL-HMAC-V3\n%s\n%s\n%s\n%s\n%s\n%s' "$method" "$path" "$ts" "$key_id" "$session" "$body" \
      | openssl dgst -sha256 "${mac[@]}" -hex | sed 's/^.*= //')
args=(-sS -X "$method" "$gateway$path" -H "X-Timestamp: $ts" -H "X-Signature-Version: 3" -H "X-Signature: $sig")
if [ -n "$key_id" ]; then args+=(-H "X-Key-Id: $key_id"); fi
if [ -n "$session" ]; then args+=(-H "X-Agent-Session-Id: $session"); fi
if [ -n "$body" ]; then args+=(-H 'Content-Type: application/json' --data-binary "$body"); fi
curl "${args[@]}" "$@"
echo
