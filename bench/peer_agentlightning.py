"""Runs agentlightning's LLM proxy (LiteLLM-based) for the capture bench; executed by bench/.peers/agentlightning's
Python, never imported by our code.

    bench/.peers/agentlightning/bin/python bench/peer_agentlightning.py --port P --upstream http://127.0.0.1:U

An in-memory LightningStore; one model `tiny` routed to the upstream as a hosted vLLM; the default middlewares and
callbacks (rollout/attempt routing, return_token_ids, OpenTelemetry spans into the store). Captured path:
`/rollout/<rollout>/attempt/<attempt>/v1/chat/completions`.
"""

from __future__ import annotations

import argparse
import threading


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    from agentlightning import LLMProxy
    from agentlightning.store.memory import InMemoryLightningStore

    store = InMemoryLightningStore()
    proxy = LLMProxy(
        port=args.port, host="127.0.0.1", store=store, launch_mode="thread",
        model_list=[{"model_name": "tiny", "litellm_params": {"model": "hosted_vllm/tiny",
                                                              "api_base": args.upstream + "/v1"}}],
    )
    proxy.start()
    threading.Event().wait()


if __name__ == "__main__":
    main()
