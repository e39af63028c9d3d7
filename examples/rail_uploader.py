"""An agent that is not behind the gateway feeding online RL with rail-v1 uploads through `RLOnlineRail`.

    # through the gateway (uploads signed with the agent's own key), the model called directly on a vLLM server:
    .venv/bin/python examples/rail_uploader.py --url http://127.0.0.1:8080 --key-file rail-bot.key.json \
        --vllm http://127.0.0.1:8000 --model tiny
    # straight to an RL Service that has a token, with canned replies instead of a model:
    .venv/bin/python examples/rail_uploader.py --url http://127.0.0.1:18081 --token "$RL_SERVICE_TOKEN"

The agent holds a short conversation. After each model call it reports the step (messages, reply, token ids and
logprobs: read from vLLM's answer when it is asked with `return_token_ids` and `logprobs`); the user's next message
is reported as feedback on the previous reply; the end of the conversation closes the session. The service's Judge
scores each reply with that feedback and stores the samples as pending (the operator's `openjiuwen-rl rl traj list`).
The RL Service must have a Judge configured (`judge_endpoint`). The agent key file comes from the operator
(`openjiuwen-rl keys add-agent rail-bot --key-file gateway-keys.json --out rail-bot.key.json`): that key may upload
rail batches, never more.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from typing import Any

import httpx

from openjiuwen.agent_evolving.agent_rl.common.signing_keys import load_agent_key
from openjiuwen.agent_evolving.agent_rl.rail import RLOnlineRail, TrajectoryUploader

USER_TURNS = [
    "What is the capital of France?",
    "Thanks. And roughly how many people live there?",
    "Great, that is all I needed.",
]


async def ask_vllm(client: httpx.AsyncClient, model: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One completion with the fields rail-v1 needs: prompt and response token ids, one logprob per token."""
    resp = await client.post("/v1/chat/completions", json={
        "model": model, "messages": messages, "max_tokens": 64,
        "logprobs": True, "return_token_ids": True,
    })
    resp.raise_for_status()
    return resp.json()


def canned(turn: int) -> dict[str, Any]:
    """A reply shaped like vLLM's, for trying the upload path without a model server."""
    text = ["Paris.", "About two million in the city itself.", "Glad to help."][turn]
    tokens = list(text.encode())
    return {
        "object": "chat.completion", "model": "canned", "prompt_token_ids": [1, 100 + turn, 200 + turn],
        "choices": [{"index": 0, "finish_reason": "stop", "token_ids": tokens,
                     "message": {"role": "assistant", "content": text},
                     "logprobs": {"content": [{"logprob": -0.5} for _ in tokens]}}],
    }


async def run(args: argparse.Namespace) -> int:
    sign_key = load_agent_key(args.key_file) if args.key_file else None
    session = "rail-example-" + uuid.uuid4().hex[:8]
    vllm = httpx.AsyncClient(base_url=args.vllm, timeout=120) if args.vllm else None
    try:
        async with TrajectoryUploader(endpoint=args.url, sign_key=sign_key, bearer=args.token or None,
                                      flush_interval_s=0.2) as uploader:
            rail = RLOnlineRail(uploader, session_id=session, policy_version=args.policy)
            messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a terse assistant."}]
            for turn, user_text in enumerate(USER_TURNS):
                if turn:
                    rail.on_user_feedback(user_text)  # the user's next message is their feedback on the last reply
                messages.append({"role": "user", "content": user_text})
                completion = await ask_vllm(vllm, args.model, messages) if vllm else canned(turn)
                sample_id = await rail.on_step(messages, completion)  # queued; uploads run in the background
                reply = completion["choices"][0]["message"].get("content") or ""
                print(f"{sample_id}: {reply!r}")
                messages.append({"role": "assistant", "content": reply})
            await rail.on_session_end()
        # Leaving the `async with` flushed the queue; the counters say what reached the service.
    finally:
        if vllm is not None:
            await vllm.aclose()
    metrics = uploader.metrics
    print(f"session {session}: {metrics.samples_sent} samples sent in {metrics.sent} batches, "
          f"{metrics.retried} retries, {metrics.samples_lost} lost, {metrics.judge_failed} not judged")
    if uploader.last_error:
        print(f"last error: {uploader.last_error}", file=sys.stderr)
    return 0 if metrics.samples_lost == 0 and metrics.judge_failed == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="gateway or RL Service base URL")
    parser.add_argument("--key-file", help="the agent's own key file (openjiuwen-rl keys add-agent): sign the uploads")
    parser.add_argument("--token", default="", help="RL_SERVICE_TOKEN, when uploading to an RL Service directly")
    parser.add_argument("--vllm", default="", help="vLLM base URL; without it the replies are canned")
    parser.add_argument("--model", default="tiny", help="the model (or LoRA) name to ask vLLM for")
    parser.add_argument("--policy", default="base", help="policy that produced the replies: base or <model>:vN")
    return asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
