"""Runs agentlightning's LLM proxy (LiteLLM-based) for the capture bench; executed by bench/.peers/agentlightning's
Python, never imported by our code.

    bench/.peers/agentlightning/bin/python bench/peer_agentlightning.py --port P --upstream http://127.0.0.1:U \
        --sessions N --sessions-file F

An in-memory LightningStore (not thread-safe: the server runs as an asyncio task in this process); one model `tiny` routed to the upstream as a hosted vLLM; the default middlewares and
callbacks (rollout/attempt routing, return_token_ids, OpenTelemetry spans into the store). Captured path:
`/rollout/<rollout>/attempt/<attempt>/v1/chat/completions`. The store drops the spans of a rollout it does not know
("ValueError: Rollout r2 not found"), so N rollouts are started in the store first and their (rollout, attempt) ids
written as a JSON list to F once the proxy answers: session i of the bench uses entry i.

In agentlightning 0.3.0 `LLMProxy.start()` is a coroutine (it awaits the server launcher, which starts uvicorn and
polls the health URL): called without `await`, nothing starts and the port never answers. LiteLLM would also fetch
its model-cost map from GitHub at import time (5 s timeout, then the packaged copy): LITELLM_LOCAL_MODEL_COST_MAP=True
keeps it offline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os


async def serve(port: int, upstream: str, sessions: int, sessions_file: str) -> None:
    from agentlightning import LLMProxy
    from agentlightning.store.memory import InMemoryLightningStore

    store = InMemoryLightningStore()
    proxy = LLMProxy(
        port=port, host="127.0.0.1", store=store, launch_mode="asyncio",
        model_list=[{"model_name": "tiny", "litellm_params": {"model": "hosted_vllm/tiny",
                                                              "api_base": upstream + "/v1"}}],
    )
    await proxy.start()
    ids = []
    for i in range(sessions):
        attempted = await store.start_rollout(input={"bench_session": i})
        ids.append([attempted.rollout_id, attempted.attempt.attempt_id])
    tmp = sessions_file + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(ids, f)
    os.replace(tmp, sessions_file)
    await asyncio.Event().wait()  # until terminated


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--sessions-file", required=True)
    args = parser.parse_args()
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    # LiteLLM >= 1.108 refuses to start without a master key unless told this is local development (loopback only).
    os.environ.setdefault("LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY", "true")
    asyncio.run(serve(args.port, args.upstream, args.sessions, args.sessions_file))


if __name__ == "__main__":
    main()
