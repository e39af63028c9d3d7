"""Added latency of a captured completion versus a bypassed one through the reference gateway.

    .venv/bin/python bench/gateway_bench.py [--calls 500] [--tokens 256] [--concurrency 1 16]

Real processes: the gateway, its RL Service child and a private redis-server; one fake vLLM instance (recorded
shapes, no model) in this process. The same JSON chat completion is sent `--calls` times without a session header
(bypass) and with the session of an active Task (captured: `:before` → upstream → `:after`). Prints p50/p99 per
mode and the difference, writes bench/results/gateway.json. Loopback only, bounded loops.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hooks_bench import percentile  # noqa: E402
from tests.support.fake_vllm import FakeVLLM, Reply  # noqa: E402
from tests.support.gateway_process import GatewayProcess  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402


async def measure(url: str, body: bytes, headers: dict[str, str], calls: int, concurrency: int) -> dict:
    latencies: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def one() -> None:
            async with sem:
                t0 = time.perf_counter()
                r = await c.post("/v1/chat/completions", content=body, headers=headers)
                latencies.append((time.perf_counter() - t0) * 1000)
                assert r.status_code == 200, r.text
        for _ in range(min(20, calls)):  # warm-up: connections, imports, caches
            await one()
        latencies.clear()
        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(calls)))
        wall = time.perf_counter() - started
    return {"p50_ms": statistics.median(latencies), "p99_ms": percentile(latencies, 99),
            "mean_ms": statistics.fmean(latencies), "throughput_rps": calls / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "gateway.json"))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="rl-gw-bench-") as tmp, RedisServer(Path(tmp) / "redis") as redis_server, \
            FakeVLLM(served_model="tiny", name="bench-vllm") as vllm:
        vllm.reply = Reply(content="word " * (args.tokens * 2))
        with GatewayProcess(Path(tmp), redis_server.url, instances=[vllm],
                            rl_overrides={"max_body_bytes": 64 * 1024 * 1024}) as gw:
            gw.start_service()
            assert gw.start_task("bench-session").status_code == 201
            body = orjson.dumps({"model": "tiny", "max_tokens": args.tokens,
                                 "messages": [{"role": "user", "content": "benchmark " * 64}]})
            plain = {"content-type": "application/json"}
            captured = dict(plain, **{"X-Agent-Session-Id": "bench-session"})
            for concurrency in args.concurrency:
                bypass = asyncio.run(measure(gw.url, body, plain, args.calls, concurrency))
                capture = asyncio.run(measure(gw.url, body, captured, args.calls, concurrency))
                results.append({"concurrency": concurrency, "bypass": bypass, "captured": capture,
                                "added_p50_ms": capture["p50_ms"] - bypass["p50_ms"],
                                "added_p99_ms": capture["p99_ms"] - bypass["p99_ms"]})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(orjson.dumps({"calls": args.calls, "tokens": args.tokens, "results": results},
                                option=orjson.OPT_INDENT_2).decode())
    print(f"gateway: {args.calls} JSON completions of {args.tokens} tokens per mode, fake upstream")
    print(f"  {'conc':>4} {'bypass p50':>11} {'p99':>8} {'captured p50':>13} {'p99':>8} {'added p50':>10} "
          f"{'added p99':>10} {'bypass rps':>11} {'captured rps':>13}")
    for r in results:
        b, c = r["bypass"], r["captured"]
        print(f"  {r['concurrency']:>4} {b['p50_ms']:11.2f} {b['p99_ms']:8.2f} {c['p50_ms']:13.2f} {c['p99_ms']:8.2f} "
              f"{r['added_p50_ms']:10.2f} {r['added_p99_ms']:10.2f} {b['throughput_rps']:11.1f} "
              f"{c['throughput_rps']:13.1f}")
    print(f"  written to {out}")


if __name__ == "__main__":
    main()
