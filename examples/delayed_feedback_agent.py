"""A delayed-feedback conversation: the RL Service's Judge scores each turn when the user's next message arrives.

    .venv/bin/python examples/delayed_feedback_agent.py --gateway http://127.0.0.1:8080 --key-file trip-bot.key.json

Needs `judge_endpoint`/`judge_model` in the RL Service config (any OpenAI-compatible chat endpoint) and an agent key
file (`openjiuwen-rl keys add-agent`, see examples/openai_agent.py). Each agent turn carries `X-Agent-Turn-Id`; the
first completion of turn N+1 makes the RL Service judge turn N with the new user message as feedback; stopping the
Task judges the last turn with no feedback. No terminal reward is sent. The judged samples are the operator's to
read: `openjiuwen-rl rl traj list --status pending`, then `rl traj get ID`.
"""

from __future__ import annotations

import argparse
import uuid

import httpx
import openai

from openai_agent import signed  # the same signing helper (this folder is on sys.path)
from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import RequestSigner
from openjiuwen.agent_evolving.agent_rl.common.signing_keys import load_agent_key

USER_TURNS = ["Plan a two-day trip to Lyon.", "Too expensive, cheaper please.", "Great, thanks!"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8080")
    parser.add_argument("--key-file", required=True, help="the agent's own key file (openjiuwen-rl keys add-agent)")
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    key = RequestSigner(load_agent_key(args.key_file))
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
        stopped = signed(control, key, "POST", f"/v1/rl/tasks/{task['rl_task_id']}/stop").raise_for_status().json()
        print("stop:", stopped["status"], "- the Judge scored each turn; the operator reads the samples of session",
              session)


if __name__ == "__main__":
    main()
