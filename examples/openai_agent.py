"""An agent using the official `openai` SDK through the gateway, rewarded at the end of its Task (terminal reward).

    openjiuwen-rl keys add-agent colour-bot --key-file gateway-keys.json --out colour-bot.key.json  # the operator,
    # once (then restart the gateway); the operator also starts the RL Service: openjiuwen-rl rl service start
    .venv/bin/python examples/openai_agent.py --gateway http://127.0.0.1:8080 --key-file colour-bot.key.json

The agent signs with its own agent key, which may start, stop and reward its own Tasks and nothing else: it starts a
Task for its session (with a capture secret), stops it when it is done and submits the reward. In between it sends
plain chat completions with `X-Agent-Session-Id` and the Task's `X-Agent-Capture-Secret`; the gateway captures them
with their token ids and logprobs, and the agent never sees those private fields. Without the secret, knowing the
session id would be enough to write into the Task.
"""

from __future__ import annotations

import argparse
import json
import uuid

import httpx
import openai

from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import RequestSigner
from openjiuwen.agent_evolving.agent_rl.common.signing_keys import load_agent_key


def signed(client: httpx.Client, signer: RequestSigner, method: str, path: str, body: dict | None = None,
           headers: dict[str, str] | None = None) -> httpx.Response:
    """A signed control request: the signature covers the method, the path and query as sent, the session header,
    the key id and the body. One signer per key keeps its timestamps strictly increasing."""
    raw = b"" if body is None else json.dumps(body).encode()
    h = {"content-type": "application/json"} if body is not None else {}
    h.update(headers or {})
    return client.send(signer.sign_httpx(client.build_request(method, path, content=raw, headers=h)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8080")
    parser.add_argument("--key-file", required=True,
                        help='the agent\'s own key file {"agentKeyId", "agentHmacKey"} (openjiuwen-rl keys add-agent)')
    parser.add_argument("--model", default="tiny", help="the model id the gateway serves")
    args = parser.parse_args()
    key = RequestSigner(load_agent_key(args.key_file))
    session = "agent-" + uuid.uuid4().hex[:8]
    with httpx.Client(base_url=args.gateway, timeout=330) as control:
        task = signed(control, key, "POST", "/v1/rl/tasks/start", {"reward_mode": "terminal", "capture_secret": True},
                      {"X-Agent-Session-Id": session}).raise_for_status().json()
        print("task", task["rl_task_id"], "pinned to", task["policy_lora_name"])

        agent = openai.OpenAI(base_url=args.gateway + "/v1", api_key="unused",
                              default_headers={"X-Agent-Session-Id": session,
                                               "X-Agent-Capture-Secret": task["capture_secret"]})
        messages = [{"role": "user", "content": "Name a colour."}]
        for _ in range(2):  # a two-step "agent": the second call sees the first answer
            out = agent.chat.completions.create(model=args.model, messages=messages, max_tokens=16)
            answer = out.choices[0].message.content or ""
            print("agent:", answer)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Another one."}]

        signed(control, key, "POST", f"/v1/rl/tasks/{task['rl_task_id']}/stop").raise_for_status()
        reward = 1.0 if "red" in answer.lower() else 0.0  # the task's verifiable outcome
        print("reward:", signed(control, key, "POST", f"/v1/rl/tasks/{task['rl_task_id']}/reward",
                                {"reward": reward}).raise_for_status().json())


if __name__ == "__main__":
    main()
