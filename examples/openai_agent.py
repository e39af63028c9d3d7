"""An agent using the official `openai` SDK through the gateway, rewarded at the end of its Task (terminal reward).

    .venv/bin/python examples/openai_agent.py --gateway http://127.0.0.1:8080 --key-file keys.json

The operator side (signed): start the RL Service if needed, start a Task for the agent's session (with a capture
secret), stop it when the agent is done, submit the reward. The agent side (unsigned): plain chat completions with
`X-Agent-Session-Id` and the Task's `X-Agent-Capture-Secret`; the gateway captures them with their token ids and
logprobs, and the agent never sees those private fields. Without the secret, knowing the session id would be enough
to write into the Task.
"""

from __future__ import annotations

import argparse
import json
import uuid

import httpx
import openai

from openjiuwen.agent_evolving.agent_rl.gateway.config import keys_from_document
from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import RequestSigner


_signers: dict[bytes, RequestSigner] = {}


def signed(client: httpx.Client, key: bytes, method: str, path: str, body: dict | None = None,
           headers: dict[str, str] | None = None) -> httpx.Response:
    """A signed control request: the signature covers the method, the path and query as sent, and the body."""
    raw = b"" if body is None else json.dumps(body).encode()
    h = {"content-type": "application/json"} if body is not None else {}
    h.update(headers or {})
    signer = _signers.setdefault(key, RequestSigner(key))  # strictly increasing timestamps per key
    return client.send(signer.sign_httpx(client.build_request(method, path, content=raw, headers=h)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="http://127.0.0.1:8080")
    parser.add_argument("--key-file", required=True, help='JSON file with {"apiHmacKey": ...}')
    parser.add_argument("--model", default="tiny", help="the model id the gateway serves")
    args = parser.parse_args()
    with open(args.key_file, "rb") as fh:
        key = keys_from_document(json.loads(fh.read()), source=args.key_file).api
    session = "agent-" + uuid.uuid4().hex[:8]
    with httpx.Client(base_url=args.gateway, timeout=330) as control:
        if signed(control, key, "GET", "/v1/rl/service").json()["status"] != "running":
            signed(control, key, "POST", "/v1/rl/service/start").raise_for_status()
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
                                {"reward": reward}).json())
        print("stats:", signed(control, key, "GET", "/v1/rl/trajectories/stats").json())


if __name__ == "__main__":
    main()
