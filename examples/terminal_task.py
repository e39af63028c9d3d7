"""One terminal-reward Task driven over HTTP, the way a gateway drives the RL Service.

Start the service first (see README), then:

    .venv/bin/python examples/terminal_task.py --url http://127.0.0.1:18081 [--token $RL_SERVICE_TOKEN]

The gateway normally mints the Task id, chooses the pinned policy and sends the completion to vLLM between
`:before` and `:after`; this script plays that part with a response shaped like vLLM 0.32's, so the model id in the
service config must match `--model` (default `tiny`).
"""

from __future__ import annotations

import argparse
import json
import uuid

import httpx


def fake_vllm_response(model: str, request: dict) -> dict:
    prompt_ids = [1, 306, 323, 201, 59, 81]
    token_ids = [297, 97, 147, 93]
    return {
        "id": "chatcmpl-example",
        "object": "chat.completion",
        "model": model,
        "prompt_token_ids": prompt_ids,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Paris."},
                "finish_reason": "stop",
                "token_ids": token_ids,
                "logprobs": {"content": [{"token": "x", "logprob": -0.5 - i / 10} for i in range(len(token_ids))]},
            }
        ],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(token_ids),
                  "total_tokens": len(prompt_ids) + len(token_ids)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:18081")
    parser.add_argument("--token", default="")
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else {}
    task_id = "t" + uuid.uuid4().hex
    with httpx.Client(base_url=args.url, headers=headers, timeout=30) as rl:
        task = rl.post(
            "/v1/rl/tasks/start",
            json={"reward_mode": "terminal"},
            headers={"X-Agent-Session-Id": "example-session", "X-AIGW-RL-Task-Id": task_id,
                     "X-AIGW-RL-Policy-Name": "base", "X-AIGW-RL-Policy-Model": args.model},
        ).raise_for_status().json()
        task_id = task["rl_task_id"]  # a busy session returns its active Task
        print("task:", json.dumps(task))

        request = {"model": args.model, "messages": [{"role": "user", "content": "Capital of France?"}]}
        hook = {"rl_task_id": task_id, "capture_id": "c-" + uuid.uuid4().hex[:12], "agent_turn_id": None}
        injected = rl.post("/internal/v1/completions:before", json=dict(hook, request=request)).raise_for_status()
        injected_request = injected.json()["request"]
        print("injected flags:", {k: injected_request[k] for k in ("logprobs", "top_logprobs", "return_token_ids")})
        response = fake_vllm_response(args.model, injected_request)
        rl.post("/internal/v1/completions:after", json=dict(hook, request=injected_request, response=response)
                ).raise_for_status()

        print("stop:", rl.post(f"/v1/rl/tasks/{task_id}/stop").raise_for_status().json()["status"])
        print("reward:", rl.post(f"/v1/rl/tasks/{task_id}/reward", json={"reward": 1.0}).raise_for_status().json())
        print("stats:", rl.get("/v1/rl/trajectories/stats").raise_for_status().json())
        sample = rl.get(f"/v1/rl/trajectories/{hook['capture_id']}").raise_for_status().json()
        print("sample:", {k: sample[k] for k in ("sample_id", "status", "policy_version", "judge")})


if __name__ == "__main__":
    main()
