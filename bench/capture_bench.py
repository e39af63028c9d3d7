"""Capture overhead: the same fixed-latency fake upstream reached (a) directly, (b) through our gateway without a Task
(bypass) and (c) through our gateway with capture into the RL Service, at several concurrent session counts, for JSON
and SSE, for a small and a large completion, and (d) through peer capture gateways installed from PyPI into
bench/.peers/ (see bench/peers.py) in the same run.

    .venv/bin/python bench/capture_bench.py [--quick] [--concurrency 1 16 64 256] [--latency-ms 200]

Real processes on loopback: a private redis-server, bench/upstream.py (pre-rendered vLLM 0.32 bodies with token ids
and logprobs), the gateway and its RL Service child. Each session is one keep-alive connection with its own
`X-Agent-Session-Id` (captured mode: one active Task per session). Added latency = captured − bypass at the same
percentile; throughput = completed calls / wall time of the closed loop. Prints a table, writes
bench/results/capture.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import peers as peer_gateways  # noqa: E402
from bench.load import closed_loop, post  # noqa: E402
from bench.machine import machine_facts, write_result  # noqa: E402
from tests.support.gateway_process import GatewayProcess  # noqa: E402
from tests.support.redis_server import RedisServer, free_port  # noqa: E402

SIZES = {"small": (512, 256), "large": (2048, 2048)}
WORDS = ["alpha", "beta", "gamma", "delta", "tool", "call", "result", "plan", "step", "answer"]


class Upstream:
    """bench/upstream.py as a child process on a fixed port (restarted per completion size)."""

    def __init__(self, port: int, latency_ms: float) -> None:
        self.port, self.latency_ms, self.proc = port, latency_ms, None

    def start(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.stop()
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "upstream.py"), "--port", str(self.port), "--latency-ms",
             str(self.latency_ms), "--prompt-tokens", str(prompt_tokens), "--completion-tokens",
             str(completion_tokens)], stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("bench upstream did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


def request_body(prompt_tokens: int, completion_tokens: int, stream: bool) -> bytes:
    # ~1 token per word for the fake's purposes; the upstream answers with exactly `prompt_tokens` prompt ids.
    text = " ".join(WORDS[i % len(WORDS)] for i in range(max(1, prompt_tokens - 16)))
    body = {"model": "tiny", "max_tokens": completion_tokens, "temperature": 1.0, "stream": stream,
            "messages": [{"role": "system", "content": "You are a helpful agent."},
                         {"role": "user", "content": text}]}
    return orjson.dumps(body)


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process, from /proc."""
    fields = _stat_fields(pid)
    return sum(int(x) for x in fields[11:13]) / os.sysconf("SC_CLK_TCK") if fields else 0.0


def tree_cpu_seconds(pid: int) -> float:
    """CPU of `pid` and everything below it, the children it reaped included (cutime + cstime): an RL Service
    worker group, whose workers each spend their own CPU."""
    fields = _stat_fields(pid)
    if not fields:
        return 0.0
    total = sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        total += sum(tree_cpu_seconds(int(c)) for c in children)
    return total


TREES = ("rl_service",)  # processes measured with everything below them


def process_cpu(name: str, pid: int) -> float:
    return tree_cpu_seconds(pid) if name in TREES else cpu_seconds(pid)


def child_pid(parent: int) -> int:
    for task in Path(f"/proc/{parent}/task").iterdir():
        children = (task / "children").read_text().split()
        if children:
            return int(children[0])
    raise RuntimeError("the gateway has no RL Service child")


def _ok(status: int, body: bytes) -> None:
    if status != 200:
        raise RuntimeError(f"status {status}: {body[:300]!r}")


async def _measured(pids: dict[str, int], port: int, requests, concurrency: int, calls: int) -> dict:
    """One closed loop, plus the CPU milliseconds each process spent per call during it (robust to a noisy
    machine where wall-clock percentiles are not)."""
    before = {name: process_cpu(name, pid) for name, pid in pids.items()}
    result = await closed_loop(port, requests, concurrency=concurrency, calls=calls, check=_ok)
    n = result["calls"] + concurrency  # the warm-up calls ran inside the window too
    result["cpu_ms_per_call"] = {name: (process_cpu(name, pid) - before[name]) * 1000 / n
                                 for name, pid in pids.items()}
    return result


async def _modes(pids: dict[str, int], gw_port: int, up_port: int, body: bytes, concurrency: int,
                 calls: int, peers: list) -> dict[str, dict]:
    path = "/v1/chat/completions"
    direct = await _measured(pids, up_port, lambda i: post(path, body), concurrency, calls)
    bypass = await _measured(pids, gw_port, lambda i: post(path, body), concurrency, calls)
    captured = await _measured(
        pids, gw_port, lambda i: post(path, body, {"x-agent-session-id": f"bench-{i}"}), concurrency, calls)
    modes: dict[str, dict] = {"direct": direct, "bypass": bypass, "captured": captured}
    measured, peer_errors = await measure_peers(pids, peers, body, concurrency, calls)
    modes.update(measured)
    if peer_errors:
        modes["peer_errors"] = peer_errors
    return modes


async def measure_peers(pids: dict[str, int], peers: list, body: bytes, concurrency: int,
                        calls: int) -> tuple[dict[str, dict], dict[str, str]]:
    """({"peer:<name>": measurement}, {name: error}). A peer that resets connections or answers errors under this
    load is a finding about the peer, not a reason to lose the run: it is reported instead of measured. Our own
    modes are measured outside this and still fail the bench."""
    measured: dict[str, dict] = {}
    errors: dict[str, str] = {}
    for peer in peers:
        def request(i: int, peer=peer) -> bytes:
            peer_path, headers = peer.session_request(i)
            return post(peer_path, body, headers)
        try:
            measured[f"peer:{peer.name}"] = await _measured(dict(pids, peer=peer.proc.pid), peer.port, request,
                                                            concurrency, calls)
        except (OSError, RuntimeError) as exc:
            errors[peer.name] = f"{type(exc).__name__}: {exc}"
    return measured, errors


def committed_captures(redis_url: str) -> int:
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        return sum(1 for _ in r.scan_iter(match="rl:v1:task:*:pending:*", count=1000))
    finally:
        r.close()


def run(args: argparse.Namespace) -> dict:
    results = []
    peer_status: dict[str, str] = {}
    for name in args.peers:
        ok, why = peer_gateways.ensure(name)
        peer_status[name] = "measured" if ok else why
    usable = [n for n, status in peer_status.items() if status == "measured"]
    with tempfile.TemporaryDirectory(prefix="rl-capture-bench-") as tmp, \
            RedisServer(Path(tmp) / "redis") as redis_server:
        upstream = Upstream(free_port(), args.latency_ms)
        instance = SimpleNamespace(name="bench-upstream", port=upstream.port)
        try:
            upstream.start(*SIZES[args.sizes[0]])
            rl_overrides = {"max_body_bytes": 64 * 1024 * 1024, "workers": args.workers}
            with GatewayProcess(Path(tmp), redis_server.url, instances=[instance], rl_overrides=rl_overrides,
                                online_overrides={"hookTimeout": "60s", "hookRetries": 0}) as gw:
                gw.start_service()
                for i in range(max(args.concurrency)):
                    r = gw.start_task(f"bench-{i}")
                    assert r.status_code == 201, r.text
                expected = 0
                assert gw.proc is not None and redis_server.proc is not None
                pids = {"gateway": gw.proc.pid, "rl_service": child_pid(gw.proc.pid),
                        "redis": redis_server.proc.pid, "driver": os.getpid()}
                for size in args.sizes:
                    prompt_tokens, completion_tokens = SIZES[size]
                    upstream.start(prompt_tokens, completion_tokens)
                    assert upstream.proc is not None
                    pids["upstream"] = upstream.proc.pid
                    for fmt in args.formats:
                        body = request_body(prompt_tokens, completion_tokens, fmt == "sse")
                        running = [peer_gateways.start(n, port=free_port(), upstream_url=f"http://127.0.0.1:"
                                                       f"{upstream.port}", workdir=Path(tmp) / "peers",
                                                       sessions=max(args.concurrency))
                                   for n in usable]
                        try:
                            rows = list(_rows(args, pids, gw, upstream, body, running))
                        finally:
                            for peer in running:
                                peer.stop()
                        for row in rows:
                            row.update(size=size, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                                       format=fmt)
                            results.append(row)
                            print_row(row, flush=True)
                            expected += row["calls"] + row["concurrency"]
                committed = committed_captures(redis_server.url)
        finally:
            upstream.stop()
    return {"latency_ms": args.latency_ms, "machine": machine_facts(), "results": results, "workers": args.workers,
            "captures_expected": expected, "captures_committed": committed, "peers": peer_status}


def _rows(args: argparse.Namespace, pids: dict[str, int], gw, upstream, body: bytes, running: list):
    for concurrency in args.concurrency:
        calls = max(args.min_calls, args.calls_per_session * concurrency)
        load = os.getloadavg()[0]
        modes = asyncio.run(_modes(pids, gw.port, upstream.port, body, concurrency, calls, running))
        direct = modes["direct"]["p50_ms"]
        yield {"concurrency": concurrency, "calls": calls, "load_avg_1m": load, **modes,  # peer_errors, if any
               "added_p50_ms": modes["captured"]["p50_ms"] - modes["bypass"]["p50_ms"],
               "added_p99_ms": modes["captured"]["p99_ms"] - modes["bypass"]["p99_ms"],
               "gateway_p50_ms": modes["bypass"]["p50_ms"] - direct,
               "throughput_ratio": modes["captured"]["throughput_rps"] / modes["bypass"]["throughput_rps"],
               # Capture overhead over the direct call, comparable across gateways (peers have no bypass mode).
               "overhead_p50_ms": {name: m["p50_ms"] - direct for name, m in modes.items()
                                   if name == "captured" or name.startswith("peer:")}}


HEADER = (f"{'size':>5} {'fmt':>4} {'conc':>4} {'direct p50':>10} {'bypass p50':>10} {'p99':>7} "
          f"{'capt p50':>8} {'p99':>7} {'added p50':>9} {'added p99':>9} {'bypass rps':>10} {'capt rps':>8} "
          f"{'ratio':>5} {'load':>5}  CPU ms/call bypass→captured: gateway, rl_service, redis")


def print_row(r: dict, flush: bool = False) -> None:
    d, b, c = r["direct"], r["bypass"], r["captured"]
    print(f"{r['size']:>5} {r['format']:>4} {r['concurrency']:>4} {d['p50_ms']:10.1f} {b['p50_ms']:10.1f} "
          f"{b['p99_ms']:7.1f} {c['p50_ms']:8.1f} {c['p99_ms']:7.1f} {r['added_p50_ms']:9.2f} "
          f"{r['added_p99_ms']:9.2f} {b['throughput_rps']:10.1f} {c['throughput_rps']:8.1f} "
          f"{r['throughput_ratio']:5.2f} {r['load_avg_1m']:5.2f}  "
          f"{b['cpu_ms_per_call']['gateway']:.2f}→{c['cpu_ms_per_call']['gateway']:.2f}, "
          f"{c['cpu_ms_per_call']['rl_service']:.2f}, {c['cpu_ms_per_call']['redis']:.2f}", flush=flush)
    for name, overhead in r["overhead_p50_ms"].items():
        m = r[name]
        print(f"{'':>15}{name:<14} p50 {m['p50_ms']:8.1f}  p99 {m['p99_ms']:8.1f}  over direct p50 {overhead:8.2f}  "
              f"{m['throughput_rps']:7.1f} rps", flush=flush)
    for name, error in r.get("peer_errors", {}).items():
        print(f"{'':>15}peer:{name:<9} failed: {error}", flush=flush)


def _workers(value: str) -> str | int:
    return value if value == "auto" else int(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, concurrency 1 and 64, JSON and SSE")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None)
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=["small", "large"])
    parser.add_argument("--formats", nargs="+", choices=["json", "sse"], default=["json", "sse"])
    parser.add_argument("--latency-ms", type=float, default=200.0, help="fixed upstream latency per completion")
    parser.add_argument("--peers", nargs="*", default=sorted(peer_gateways.PEERS),
                        help="peer gateways to measure in the same run (installed into bench/.peers on first use)")
    parser.add_argument("--workers", type=_workers, default="auto",
                        help="RL Service worker processes (its `workers` setting: auto or a count; default auto)")
    parser.add_argument("--calls-per-session", type=int, default=None)
    parser.add_argument("--min-calls", type=int, default=None)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "capture.json"))
    args = parser.parse_args()
    if args.concurrency is None:
        args.concurrency = [1, 64] if args.quick else [1, 16, 64, 256]
    if args.calls_per_session is None:
        args.calls_per_session = 2 if args.quick else 4
    if args.min_calls is None:
        args.min_calls = 30 if args.quick else 100
    print(f"capture overhead: upstream latency {args.latency_ms:.0f} ms; small = {SIZES['small'][0]}+"
          f"{SIZES['small'][1]} tokens, large = {SIZES['large'][0]}+{SIZES['large'][1]}; times in ms")
    print(HEADER, flush=True)
    result = run(args)
    out = write_result(result, args.out)
    print(f"captures committed {result['captures_committed']} of {result['captures_expected']} sent; "
          f"peers: {result['peers'] or 'none'}; written to {out}")


if __name__ == "__main__":
    main()
