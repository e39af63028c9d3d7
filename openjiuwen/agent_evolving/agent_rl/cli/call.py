"""`openjiuwen-rl call METHOD PATH`: one HMAC-signed control request to a gateway (CONTRACT §3.2).

    openjiuwen-rl call POST /v1/rl/service/start --key-file /etc/openjiuwen/gateway-keys.json
    openjiuwen-rl call POST /v1/rl/tasks/start --key-file support-bot.key.json \
        --data '{"reward_mode": "terminal"}' -H 'X-Agent-Session-Id: s1'

Signs with the key of the key file: the gateway's (the operator key) or an agent's own (an agent key, which may
only start, stop and reward its Tasks and upload rail batches). Prints the status line and the body; exits 0 for a
2xx answer, 1 otherwise, 2 for a key file it cannot use.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="openjiuwen-rl call", description="Send one HMAC-signed control request.")
    parser.add_argument("method", help="HTTP method, e.g. GET or POST")
    parser.add_argument("path", help="path and query, e.g. /v1/rl/trajectories/stats")
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="gateway base URL (default %(default)s)")
    parser.add_argument("--key-file", required=True,
                        help="the gateway's key file (operator key) or an agent's own key file (agent key)")
    parser.add_argument("--data", default="", help="request body (JSON text); empty for bodiless requests")
    parser.add_argument("-H", "--header", action="append", default=[], help="extra header 'Name: value'")
    parser.add_argument("--timeout", type=float, default=330.0, help="seconds (default %(default)s)")
    args = parser.parse_args(argv)

    import httpx

    from ..common.hmac_signing import HmacAuth
    from ..common.signing_keys import KeyFileError, load_signing_key

    try:
        key = load_signing_key(args.key_file)
    except KeyFileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    body = args.data.encode()
    headers = {"content-type": "application/json"} if body else {}
    for line in args.header:
        name, _, value = line.partition(":")
        headers[name.strip()] = value.strip()
    with httpx.Client(timeout=args.timeout, auth=HmacAuth(key)) as client:
        resp = client.request(args.method.upper(), args.url.rstrip("/") + args.path, content=body, headers=headers)
    print(f"{resp.status_code} {resp.reason_phrase}")
    if resp.content:
        print(resp.text)
    return 0 if resp.is_success else 1


if __name__ == "__main__":
    sys.exit(main())
