"""The gateway's peak memory while a vLLM instance sends an answer far larger than any real one (issue 28 item 4).

    .venv/bin/python bench/upstream_size_bench.py [--answer-mib 300] [--limit-mib 64] [--stream] [--out FILE]

Starts the gateway (its RL Service is not started: the call bypasses capture) over a fake vLLM that writes one chat
answer of `--answer-mib` MiB as it generates it (tests/support/fake_vllm.py `bloat_next`), sends one completion
(JSON, or SSE with `--stream`) and reports the gateway's resident memory before the call and its peak (VmHWM) after,
what the client got, how many bytes it read, and how many the fake got out before the gateway stopped reading.
`--limit-mib` sets `global.maxUpstreamBodyBytes`; 0 leaves the key out (the default bound, or none at all in a
gateway that predates it). Prints numbers and writes them to `--out` (JSON); there is no target.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.fake_vllm import FakeVLLM  # noqa: E402
from tests.support.gateway_process import GatewayProcess  # noqa: E402

MIB = 1 << 20


def _kib(pid: int, field: str) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    assert match is not None, field
    return int(match.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answer-mib", type=int, default=300, help="size of the vLLM answer (default 300)")
    parser.add_argument("--limit-mib", type=int, default=64,
                        help="global.maxUpstreamBodyBytes in MiB; 0 leaves the key out (default 64)")
    parser.add_argument("--stream", action="store_true", help="ask for SSE instead of JSON")
    parser.add_argument("--out", type=Path, help="write the numbers here as JSON")
    args = parser.parse_args(argv)

    overrides = {"maxUpstreamBodyBytes": args.limit_mib * MIB} if args.limit_mib else {}
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
               "stream": args.stream}
    with tempfile.TemporaryDirectory() as tmp, FakeVLLM(served_model="tiny") as vllm, \
            GatewayProcess(Path(tmp), "redis://127.0.0.1:1/0", instances=[vllm], global_overrides=overrides) as gw:
        assert gw.proc is not None
        pid = gw.proc.pid
        assert gw.http.post("/v1/chat/completions", json=request).status_code == 200  # warm, as a serving gateway
        rss_before = _kib(pid, "VmRSS")
        vllm.bloat_next(args.answer_mib * MIB)
        started = time.perf_counter()
        with httpx.Client(base_url=gw.url, timeout=600) as client:
            answer = client.post("/v1/chat/completions", json=request)
        seconds = time.perf_counter() - started
        deadline = time.monotonic() + 30
        while not vllm.bloat_sent and time.monotonic() < deadline:
            time.sleep(0.05)
        code = answer.json()["error"]["code"] if answer.headers.get("content-type") == "application/json" \
            and answer.status_code != 200 else None
        result = {
            "answer_mib": args.answer_mib, "limit_mib": args.limit_mib or None, "stream": args.stream,
            "status": answer.status_code, "code": code, "client_read_mib": round(len(answer.content) / MIB, 1),
            "upstream_sent_mib": round(vllm.bloat_sent[0] / MIB, 1) if vllm.bloat_sent else None,
            "rss_before_mib": round(rss_before / 1024, 1), "peak_rss_mib": round(_kib(pid, "VmHWM") / 1024, 1),
            "seconds": round(seconds, 2),
        }
    print(" ".join(f"{k}={v}" for k, v in result.items()))
    if args.out is not None:
        args.out.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
