"""Storage: Redis bytes per captured token over a multi-turn workload, ours against the naive JSON document.

    .venv/bin/python bench/storage_bench.py [--sessions 8] [--turns 4] [--first-prompt-tokens 1024] [--completion-tokens 512] [--service sdk]

The RL Service runs as a real process against a private redis-server. Each session is one terminal Task whose turn k
repeats the whole conversation so far (turn k's prompt = turn k−1's prompt + its completion + a new user message, as
an agent loop sends it), with vLLM 0.32-shaped responses (token ids, logprobs with one top logprob). Every capture
goes through `:before`/`:after`; then stop + reward publish them. Measured with `MEMORY USAGE … SAMPLES 0`:
every published `rl:v1:traj:*` hash plus every shared `rl:v1:prompt_block:*` (prompt-prefix sharing), against the
naive layout (the full logical sample document as one JSON string, stored and measured in the same Redis). Captured
tokens = prompt + completion tokens of every sample. Also counts the prompt ids Redis holds (shared blocks once +
per-sample tails) against the captured prompt ids. Prints a table, writes bench/results/storage.json. `--service sdk`
stores the same captures through the online-RL service of PyPI's `openjiuwen` SDK (bench/.peers/openjiuwen, its own
private redis-server; see bench/hooks_bench.py) and writes bench/results/storage-sdk.json: the same
`rl:v1:traj:{capture id}` keys measured the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.hooks_bench import MODEL, SERVICES, start_service, stop_service, synthetic_exchange  # noqa: E402
from bench.machine import machine_facts, write_result  # noqa: E402
from tests.support.redis_server import RedisServer  # noqa: E402


def conversation(args: argparse.Namespace, seed: int) -> list[tuple[dict, dict]]:
    """(request, response) per turn; prompts grow by the previous completion and a new user message."""
    rng = random.Random(seed)
    turns = []
    prompt_ids = [rng.randrange(3, 151_000) for _ in range(args.first_prompt_tokens)]
    messages = [{"role": "system", "content": "You are a helpful agent."}]
    user = " ".join(rng.choice(["plan", "the", "next", "step", "tool", "call", "result"])
                    for _ in range(args.first_prompt_tokens))
    for k in range(args.turns):
        messages = [*messages, {"role": "user", "content": user}]
        request, response = synthetic_exchange(len(prompt_ids), args.completion_tokens, seed=seed * 100 + k)
        request["messages"] = list(messages)
        response["prompt_token_ids"] = list(prompt_ids)
        turns.append((request, response))
        answer = response["choices"][0]
        messages.append({"role": "assistant", "content": answer["message"]["content"]})
        user = f"tool result {k}: ok"
        prompt_ids = prompt_ids + answer["token_ids"] + [rng.randrange(3, 151_000) for _ in range(16)]
    return turns


async def run(args: argparse.Namespace, workdir: Path) -> dict:
    from redis.asyncio import Redis

    from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample

    with RedisServer(workdir / "redis") as redis_server:
        extra = {"max_body_bytes": 64 * 1024 * 1024}
        proc, port = start_service(args.service, workdir, redis_server.url, **extra)
        redis = Redis.from_url(redis_server.url)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
                captured_tokens = 0
                ids = []
                prompts: dict[str, list[int]] = {}
                for s in range(args.sessions):
                    t = f"st{s}"
                    headers = {"X-Agent-Session-Id": f"ss{s}", "X-AIGW-RL-Task-Id": t,
                               "X-AIGW-RL-Policy-Name": "base", "X-AIGW-RL-Policy-Model": MODEL}
                    r = await client.post("/v1/rl/tasks/start", json={"reward_mode": "terminal"}, headers=headers)
                    assert r.status_code == 201, r.text
                    for k, (request, response) in enumerate(conversation(args, seed=s + 1)):
                        c = f"sc-{s}-{k}"
                        hook = {"rl_task_id": t, "capture_id": c, "agent_turn_id": None}
                        r = await client.post("/internal/v1/completions:before", json={**hook, "request": request})
                        assert r.status_code == 200, r.text
                        r = await client.post("/internal/v1/completions:after", content=orjson.dumps(
                            {**hook, "request": r.json()["request"], "response": response}),
                            headers={"content-type": "application/json"})
                        assert r.status_code == 204, r.text
                        captured_tokens += len(response["prompt_token_ids"]) + args.completion_tokens
                        ids.append(c)
                        prompts[c] = response["prompt_token_ids"]
                    assert (await client.post(f"/v1/rl/tasks/{t}/stop")).status_code == 200
                    assert (await client.post(f"/v1/rl/tasks/{t}/reward", json={"reward": 1.0})).status_code == 200
                ours = 0
                naive = 0
                held_prompt_ids = 0  # prompt ids as Redis holds them: each block once, each sample's tail
                block_keys = [k async for k in redis.scan_iter(match="rl:v1:prompt_block:*", count=1000)]
                for key in block_keys:
                    ours += await redis.execute_command("MEMORY", "USAGE", key, "SAMPLES", "0")
                    held_prompt_ids += len(await redis.hget(key, "ids")) // 4
                for c in ids:
                    ours += await redis.execute_command("MEMORY", "USAGE", f"rl:v1:traj:{c}", "SAMPLES", "0")
                    held_prompt_ids += len(await redis.hget(f"rl:v1:traj:{c}", "prompt_ids") or b"") // 4
                    # The naive layout: the whole logical document as one JSON string (what the detail route shows).
                    doc = (await client.get(f"/v1/rl/trajectories/{c}")).json()
                    await redis.set("bench:naive", orjson.dumps(doc))
                    naive += await redis.execute_command("MEMORY", "USAGE", "bench:naive", "SAMPLES", "0")
                    if args.service == "ours":  # Sanity: the stored arrays are the captured ones.
                        packed = PackedSample.from_document(doc)
                        assert len(packed.prompt_ids) // 4 == len(doc["trajectory"]["prompt_ids"])
                        assert doc["trajectory"]["prompt_ids"] == prompts[c]
                await redis.delete("bench:naive")
                repeated = sum(len(r["prompt_token_ids"]) for s in range(args.sessions)
                               for r in [resp for _, resp in conversation(args, seed=s + 1)][1:])
        finally:
            await redis.aclose()
            stop_service(proc)
    return {"service": args.service, "service_label": SERVICES[args.service], "sessions": args.sessions, "turns": args.turns, "samples": len(ids),
            "first_prompt_tokens": args.first_prompt_tokens, "completion_tokens": args.completion_tokens,
            "captured_tokens": captured_tokens, "repeated_prompt_tokens": repeated,
            "captured_prompt_ids": sum(map(len, prompts.values())), "held_prompt_ids": held_prompt_ids,
            "prompt_blocks": len(block_keys),
            "bytes_per_token": {"ours": ours / captured_tokens, "naive_json": naive / captured_tokens},
            "bytes_total": {"ours": ours, "naive_json": naive}, "machine": machine_facts(),
            "load_avg_1m": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-prompt-tokens", type=int, default=1024)
    parser.add_argument("--completion-tokens", type=int, default=512)
    parser.add_argument("--service", choices=sorted(SERVICES), default="ours",
                        help="ours, or the SDK's online-RL service from bench/.peers/openjiuwen")
    parser.add_argument("--out", default=None, help="default bench/results/storage.json (storage-sdk.json for the SDK)")
    args = parser.parse_args()
    if args.out is None:
        args.out = str(ROOT / "bench" / "results" / ("storage.json" if args.service == "ours" else "storage-sdk.json"))
    with tempfile.TemporaryDirectory(prefix="rl-storage-bench-") as tmp:
        result = asyncio.run(run(args, Path(tmp)))
    out = write_result(result, args.out)
    b = result["bytes_per_token"]
    print(f"storage ({result['service_label']}): {result['samples']} samples ({result['sessions']} sessions × {result['turns']} turns), "
          f"{result['captured_tokens']} captured tokens, of which {result['repeated_prompt_tokens']} repeat an "
          f"earlier turn's prompt")
    print(f"  Redis bytes per captured token: stored {b['ours']:.2f}, naive JSON document {b['naive_json']:.2f}")
    print(f"  prompt ids held in Redis: {result['held_prompt_ids']} of {result['captured_prompt_ids']} captured "
          f"({result['prompt_blocks']} shared blocks + per-sample tails)")
    print(f"  written to {out}")


if __name__ == "__main__":
    main()
