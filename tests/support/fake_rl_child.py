"""A fake RL Service child for gateway system tests (`onlineRL.command`): answers `/health` as the RL Service does,
records each Task start's headers (one JSON line each in $FAKE_CHILD_OUT) and answers it with an active Task pinned to
the policy the gateway chose; writes its bearer token to $FAKE_CHILD_TOKEN, so that the test can call the gateway's
internal routes as the RL Service would. Standard library only: it runs as the gateway's child process."""

import http.server
import json
import os

with open(os.environ["FAKE_CHILD_TOKEN"], "w") as out:
    out.write(os.environ["RL_SERVICE_TOKEN"])


class Child(http.server.BaseHTTPRequestHandler):
    def _answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # the RL Service's /health shape (CONTRACT §2.2): the gateway checks the model id
        if self.path == "/health":
            self._answer(200, {"status": "ready", "model_id": os.environ.get("FAKE_CHILD_MODEL", "tiny")})
        else:
            self._answer(404, {"error": {"code": "not_found", "message": "fake child"}})

    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length)
        if self.path != "/v1/rl/tasks/start":
            self._answer(404, {"error": {"code": "not_found", "message": "fake child"}})
            return
        headers = {k.lower(): v for k, v in self.headers.items()}
        with open(os.environ["FAKE_CHILD_OUT"], "a") as out:
            out.write(json.dumps({"headers": headers, "body": body.decode("utf-8", "replace")}) + "\n")
        self._answer(201, {"rl_task_id": headers["x-aigw-rl-task-id"], "status": "active",
                           "agent_session_id": headers.get("x-agent-session-id", ""),
                           "policy_lora_name": headers["x-aigw-rl-policy-name"],
                           "policy_model": headers["x-aigw-rl-policy-model"], "reward_mode": "terminal"})

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["FAKE_CHILD_PORT"])), Child).serve_forever()
