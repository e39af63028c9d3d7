"""A delayed-feedback conversation: the RL Service's Judge scores each turn when the user's next message arrives.

    .venv/bin/python examples/delayed_feedback_agent.py --gateway http://127.0.0.1:8080 --key-file keys.json

Needs `judge_endpoint`/`judge_model` in the RL Service config (any OpenAI-compatible chat endpoint). Each agent turn
carries `X-Agent-Turn-Id`; the first completion of turn N+1 makes the RL Service judge turn N with the new user
message as feedback; stopping the Task judges the last turn with no feedback. No terminal reward is sent.
"""

from __future__ import annotations

import argparse
import json
import uuid

import httpx
import openai

from openai_agent import signed  # the same signing helper (this folder is on sys.path)
from openjiuwen.agent_evolving.agent_rl.gateway.config import keys_from_document

USER_TURNS = ["Plan a two-day trip to Lyon.", "Too expensive, cheaper please.", "Great, thanks!"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8080")
    parser.add_argument("--key-file", required=True)
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    with open(args.key_file, "rb") as fh:
        key = keys_from_document(json.loads(fh.read()), source=args.key_file).api
    session = "chat-" + uuid.uuid4().hex[:8]
    with httpx.Client(base_url=args.gateway, timeout=330) as control:
        task = signed(control, key, "POST", "/v1/rl/tasks/start", {"reward_mode": "delayed_feedback"},
                      {"X-Agent-Session-Id": session}).raise_for_status().json()
        agent = openai.OpenAI(base_url=args.gateway + "/v1", api_key="unused")
        messages: list[dict] = []
        for turn, text in enumerate(USER_TURNS, start=1):
            messages.append({"role": "user", "content": text})
            stream = agent.chat.completions.create(
                model=args.model, messages=messages, max_tokens=32, stream=True,
                extra_headers={"X-Agent-Session-Id": session, "X-Agent-Turn-Id": f"turn-{turn}"},
            )
            answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            print(f"turn {turn}:", answer)
            messages.append({"role": "assistant", "content": answer})
        print("stop:", signed(control, key, "POST", f"/v1/rl/tasks/{task['rl_task_id']}/stop").json()["status"])
        page = signed(control, key, "GET", "/v1/rl/trajectories?status=pending&limit=10").json()
        for item in page["items"]:
            sample = signed(control, key, "GET", f"/v1/rl/trajectories/{item['trajectory_id']}").json()
            print(item["trajectory_id"], sample["judge"]["tag"], sample["judge"]["score"])


if __name__ == "__main__":
    main()
