"""Cost of one captured completion: a `:before` + `:after` pair on a 2,048-prompt + 2,048-completion-token
response as vLLM answers the injected request (`top_logprobs=0`: each token's logprob, no alternatives), against the RL Service running as a real process on a real socket, plus the Redis
bytes kept per captured token (staged, then published).

    .venv/bin/python bench/hooks_bench.py [--pairs 200] [--prompt-tokens 2048] [--completion-tokens 2048] [--service sdk]

Prints a table and writes bench/results/hooks.json. Loopback only, bounded loop, private redis-server.
`--service sdk` runs the same workload against the online-RL service that ships in PyPI's `openjiuwen` SDK (extra
`online-rl`), installed by bench/peers.py into bench/.peers/openjiuwen and run with that environment's Python from a
temporary directory (so it never sees this repository's package) against its own private redis-server; it writes
bench/results/hooks-sdk.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import peers  # noqa: E402
from bench.machine import write_result  # noqa: E402
from tests.support.redis_server import RedisServer, free_port  # noqa: E402

MODEL = "bench-model"
SERVICES = {"ours": "this repository's RL Service",
            "sdk": "the online-RL service of PyPI's openjiuwen SDK " + peers.INSTALLS["openjiuwen"][0][0]}


def start_service(service: str, workdir: Path, redis_url: str, **extra_config) -> tuple[subprocess.Popen, int]:
    """Start an RL Service process (ours, or the SDK's from its own environment) on a free loopback port; returns
    (process, port) once its /health answers, or raises with the tail of its stderr."""
    port = free_port()
    config = workdir / "rl.yaml"
    settings = {"listen_port": port, "redis_url": redis_url, "model_id": MODEL, "base_model_path": "/models/bench",
                "lora_repository_path": str(workdir / "loras"), "log_path": str(workdir / "rl-service.log")}
    env = dict(os.environ)
    if service == "ours":
        argv, cwd = [sys.executable], ROOT
        settings.update(extra_config)
    else:
        ok, why = peers.ensure("openjiuwen")
        if not ok:
            raise RuntimeError(f"openjiuwen SDK not installed: {why}")
        # Its config forbids unknown keys; run from the temporary directory so `-m` cannot import our package.
        argv, cwd = [str(peers.python_of("openjiuwen"))], workdir
        settings["record_dir"] = str(workdir / "records")
        env.pop("PYTHONPATH", None)
    config.write_text(orjson.dumps(settings).decode())
    err = workdir / "service.err"
    with open(err, "wb") as err_file:
        proc = subprocess.Popen([*argv, "-m", "openjiuwen.agent_evolving.agent_rl.online.service", "--config",
                                 str(config)], cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=err_file,
                                stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            stop_service(proc)
            raise RuntimeError(f"{service} RL Service did not start: {err.read_text()[-2000:]}")
        time.sleep(0.1)


def stop_service(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def synthetic_exchange(prompt_tokens: int, completion_tokens: int, seed: int) -> tuple[dict, dict]:
    """A request and a vLLM 0.32-shaped response (see tests/fixtures/vllm-0.32-cpu) of the given sizes."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "tool", "call", "result", "plan", "step", "answer"]
    prompt_text = " ".join(rng.choice(words) for _ in range(prompt_tokens))
    request = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful agent."},
            {"role": "user", "content": prompt_text},
        ],
        "max_tokens": completion_tokens,
        "temperature": 1.0,
    }
    tokens = [rng.randrange(0, 151_000) for _ in range(completion_tokens)]
    pieces = [rng.choice(words) + " " for _ in range(completion_tokens)]
    content = []
    for piece in pieces:
        lp = -rng.random() * 8
        entry = {"token": piece, "logprob": lp, "bytes": list(piece.encode())}
        content.append(dict(entry, top_logprobs=[]))
    response = {
        "id": f"chatcmpl-{seed:016x}",
        "object": "chat.completion",
        "created": 1795951800,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(pieces), "refusal": None, "annotations": None,
                            "audio": None, "function_call": None, "reasoning": None},
                "logprobs": {"content": content},
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": tokens,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": "vllm-0.32.0-bench",
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                  "completion_tokens": completion_tokens, "prompt_tokens_details": None},
        "prompt_logprobs": None,
        "prompt_token_ids": [rng.randrange(0, 151_000) for _ in range(prompt_tokens)],
        "prompt_text": None,
        "kv_transfer_params": None,
    }
    return request, response


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


async def run(args: argparse.Namespace, workdir: Path) -> dict:
    with RedisServer(workdir / "redis") as redis_server:
        proc, port = start_service(args.service, workdir, redis_server.url)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                result = await measure(client, redis_server, args)
        finally:
            stop_service(proc)
    return {"service": args.service, "service_label": SERVICES[args.service], **result,
            "load_avg": list(os.getloadavg())}


async def measure(client: httpx.AsyncClient, redis_server: RedisServer, args: argparse.Namespace) -> dict:
    from redis.asyncio import Redis

    request, response = synthetic_exchange(args.prompt_tokens, args.completion_tokens, seed=7)
    per_task = 10
    latencies: list[float] = []
    before_ms: list[float] = []
    after_ms: list[float] = []
    body_bytes = 0
    tasks = []
    for i in range(args.warmup + args.pairs):
        if i % per_task == 0:
            t = f"bench{i // per_task}"
            headers = {"X-Agent-Session-Id": f"s-{t}", "X-AIGW-RL-Task-Id": t, "X-AIGW-RL-Policy-Name": "base",
                       "X-AIGW-RL-Policy-Model": MODEL}
            r = await client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"}, headers=headers)
            assert r.status_code == 201, r.text
            tasks.append(t)
        c = f"cap-{i}"
        before_body = orjson.dumps({"rl_task_id": t, "capture_id": c, "agent_turn_id": None, "request": request})
        t0 = time.perf_counter()
        r = await client.post("/internal/v1/completions:before", content=before_body,
                              headers={"content-type": "application/json"})
        t1 = time.perf_counter()
        assert r.status_code == 200, r.text
        injected = orjson.loads(r.content)["request"]
        after_body = orjson.dumps({"rl_task_id": t, "capture_id": c, "agent_turn_id": None, "request": injected,
                                   "response": response})
        t2 = time.perf_counter()
        r = await client.post("/internal/v1/completions:after", content=after_body,
                              headers={"content-type": "application/json"})
        t3 = time.perf_counter()
        assert r.status_code == 204, r.text
        if i >= args.warmup:
            before_ms.append((t1 - t0) * 1000)
            after_ms.append((t3 - t2) * 1000)
            latencies.append((t1 - t0 + t3 - t2) * 1000)
            body_bytes = len(after_body)

    tokens = args.prompt_tokens + args.completion_tokens
    redis = Redis.from_url(redis_server.url)
    try:
        staged = await redis.memory_usage(f"rl:v1:task:{tasks[-1]}:pending:cap-{args.warmup + args.pairs - 1}")
        for t in tasks:
            assert (await client.post(f"/v1/rl/tasks/{t}/stop")).status_code == 200
            assert (await client.post(f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0})).status_code == 200
        # SAMPLES 0: measure every field of the hash instead of extrapolating from five. Its shared prompt blocks
        # count in full, as if no other sample referenced them (every pair here sends the same prompt).
        last = f"rl:v1:traj:cap-{args.warmup + args.pairs - 1}"
        published = await redis.execute_command("MEMORY", "USAGE", last, "SAMPLES", "0")
        digests = await redis.hget(last, "prompt_blocks") or b""
        for i in range(0, len(digests), 16):
            published += await redis.execute_command(
                "MEMORY", "USAGE", f"rl:v1:prompt_block:{digests[i:i + 16].hex()}", "SAMPLES", "0")
        info = await redis.info("memory")
    finally:
        await redis.aclose()
    concurrent = await measure_concurrent(client, request, response, args)
    return {
        "concurrent": concurrent,
        "pairs": args.pairs,
        "prompt_tokens": args.prompt_tokens,
        "completion_tokens": args.completion_tokens,
        "after_body_bytes": body_bytes,
        "pair_ms": {"median": statistics.median(latencies), "p99": percentile(latencies, 99),
                    "mean": statistics.fmean(latencies)},
        "before_ms_median": statistics.median(before_ms),
        "after_ms_median": statistics.median(after_ms),
        "pairs_per_second": 1000 / statistics.fmean(latencies),
        "redis_bytes_per_token": {"staged": staged / tokens if staged else None,
                                  "published": published / tokens if published else None},
        "redis_used_memory_bytes": info.get("used_memory"),
    }


async def measure_concurrent(client: httpx.AsyncClient, request: dict, response: dict,
                             args: argparse.Namespace) -> dict:
    """Throughput with `--callers` concurrent callers, each driving its own Task through pairs back to back (the
    lean keep-alive client of the gateway, so the caller costs little)."""
    from openjiuwen.agent_evolving.agent_rl.gateway.http11 import Http11Client

    http = Http11Client()
    base = str(client.base_url).rstrip("/")
    json_headers = {"content-type": "application/json"}
    per_caller = max(1, args.pairs // args.callers)
    latencies: list[float] = []

    async def caller(k: int) -> None:
        t = f"conc{k}"
        headers = {"X-Agent-Session-Id": f"s-{t}", "X-AIGW-RL-Task-Id": t, "X-AIGW-RL-Policy-Name": "base",
                   "X-AIGW-RL-Policy-Model": MODEL}
        r = await client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"}, headers=headers)
        assert r.status_code == 201, r.text
        await ready.wait()
        for i in range(per_caller):
            c = f"cc-{k}-{i}"
            t0 = time.perf_counter()
            a = await http.request("POST", base + "/internal/v1/completions:before", headers=json_headers,
                                   content=orjson.dumps({"rl_task_id": t, "capture_id": c, "agent_turn_id": None,
                                                         "request": request}), timeout_s=60)
            assert a.status == 200, a.body[:300]
            injected = orjson.loads(a.body)["request"]
            a = await http.request("POST", base + "/internal/v1/completions:after", headers=json_headers,
                                   content=orjson.dumps({"rl_task_id": t, "capture_id": c, "agent_turn_id": None,
                                                         "request": injected, "response": response}), timeout_s=60)
            assert a.status == 204, a.body[:300]
            latencies.append((time.perf_counter() - t0) * 1000)

    ready = asyncio.Event()
    tasks = [asyncio.create_task(caller(k)) for k in range(args.callers)]
    await asyncio.sleep(1.0)
    started = time.perf_counter()
    ready.set()
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - started
    await http.aclose()
    return {"callers": args.callers, "pairs": len(latencies), "pairs_per_second": len(latencies) / wall,
            "median_ms": statistics.median(latencies), "p99_ms": percentile(latencies, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--callers", type=int, default=8, help="concurrent callers of the throughput measurement")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--completion-tokens", type=int, default=2048)
    parser.add_argument("--service", choices=sorted(SERVICES), default="ours",
                        help="ours, or the SDK's online-RL service from bench/.peers/openjiuwen")
    parser.add_argument("--out", default=None, help="default bench/results/hooks.json (hooks-sdk.json for the SDK)")
    args = parser.parse_args()
    if args.out is None:
        args.out = str(ROOT / "bench" / "results" / ("hooks.json" if args.service == "ours" else "hooks-sdk.json"))
    with tempfile.TemporaryDirectory(prefix="rl-bench-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    out = write_result(result, args.out)
    p = result["pair_ms"]
    print(f"{result['service_label']}: hook pair :before+:after  ({result['prompt_tokens']}+{result['completion_tokens']} tokens, "
          f"top_logprobs=0, :after body {result['after_body_bytes'] / 1024:.0f} KiB, {result['pairs']} pairs)")
    print(f"  {'median ms':>12} {'p99 ms':>10} {'mean ms':>10} {'pairs/s':>10} {'before ms':>10} {'after ms':>10}")
    print(f"  {p['median']:12.2f} {p['p99']:10.2f} {p['mean']:10.2f} {result['pairs_per_second']:10.1f} "
          f"{result['before_ms_median']:10.2f} {result['after_ms_median']:10.2f}")
    cc = result["concurrent"]
    print(f"  {cc['callers']} concurrent callers: {cc['pairs_per_second']:.1f} pairs/s, median {cc['median_ms']:.1f} ms, "
          f"p99 {cc['p99_ms']:.1f} ms")
    b = result["redis_bytes_per_token"]
    print(f"  Redis bytes per captured token: staged {b['staged'] or 0:.2f}, published {b['published'] or 0:.2f}")
    print(f"  written to {out}")


if __name__ == "__main__":
    main()
