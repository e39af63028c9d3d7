"""A fake RL Service child for gateway system tests (`onlineRL.command`): answers `/health` as the RL Service does,
records each call's headers (one JSON line each in $FAKE_CHILD_OUT) and answers a Task start with an active Task
pinned to the policy the gateway chose; writes its bearer token to $FAKE_CHILD_TOKEN, so that the test can call the
gateway's internal routes as the RL Service would.

Tasks live in $FAKE_CHILD_OUT + ".tasks" (so they outlive a gateway restart, as Redis does) and follow the RL Service's
own-Task rule: a stop or reward naming an agent key answers another key's Task as unknown (404 `task_not_found`).
`GET /v1/rl/tasks/{id}` (no agent key: the gateway's own read) answers the record, `lineage` only when not `default`.
The capture hooks answer as the RL Service does for an active Task: `:before` gives the request back (nothing
injected), `:after` and `:discard` take the capture; a Task not active is 404. Standard library only: it runs as the
gateway's child process."""

import http.server
import json
import os
import re

with open(os.environ["FAKE_CHILD_TOKEN"], "w") as out:
    out.write(os.environ["RL_SERVICE_TOKEN"])

TASKS = os.environ["FAKE_CHILD_OUT"] + ".tasks"
TASK_CALL = re.compile(r"^/v1/rl/tasks/([^/?]+)(?:/(stop|reward))?$")
NOT_FOUND = {"error": {"code": "task_not_found", "message": "RL Task not found"}}


def load_tasks():
    if not os.path.exists(TASKS):
        return {}
    with open(TASKS) as handle:
        return json.load(handle)


def save_tasks(tasks):
    with open(TASKS + ".tmp", "w") as handle:
        json.dump(tasks, handle)
    os.replace(TASKS + ".tmp", TASKS)


class Child(http.server.BaseHTTPRequestHandler):
    def _answer(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self, body):
        headers = {k.lower(): v for k, v in self.headers.items()}
        with open(os.environ["FAKE_CHILD_OUT"], "a") as out:
            out.write(json.dumps({"method": self.command, "path": self.path, "headers": headers,
                                  "body": body.decode("utf-8", "replace")}) + "\n")
        return headers

    def do_GET(self):  # the RL Service's /health shape (CONTRACT §2.2): the gateway checks the model id
        if self.path == "/health":
            self._answer(200, {"status": "ready", "model_id": os.environ.get("FAKE_CHILD_MODEL", "tiny")})
            return
        self._record(b"")
        match = TASK_CALL.match(self.path)
        task = load_tasks().get(match.group(1)) if match and not match.group(2) else None
        self._answer(200, task) if task is not None else self._answer(404, NOT_FOUND)

    def do_POST(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length)
        headers = self._record(body)
        if self.path == "/v1/rl/tasks/start":
            self._start(headers)
            return
        if self.path.startswith("/internal/v1/completions:"):
            self._hook(self.path.rpartition(":")[2], json.loads(body or b"{}"))
            return
        match = TASK_CALL.match(self.path)
        if not match or not match.group(2):
            self._answer(404, {"error": {"code": "not_found", "message": "fake child"}})
            return
        tasks = load_tasks()
        task = tasks.get(match.group(1))
        caller = headers.get("x-aigw-rl-agent-key")
        if task is None or (caller is not None and task.get("agent_key_id") != caller):
            self._answer(404, NOT_FOUND)
            return
        if match.group(2) == "stop":
            task["status"] = "finalized"
            save_tasks(tasks)
        self._answer(200, task)

    def _start(self, headers):
        task = {"rl_task_id": headers["x-aigw-rl-task-id"], "status": "active",
                "agent_session_id": headers.get("x-agent-session-id", ""),
                "policy_lora_name": headers["x-aigw-rl-policy-name"],
                "policy_model": headers["x-aigw-rl-policy-model"], "reward_mode": "terminal"}
        if "x-aigw-rl-agent-key" in headers:
            task["agent_key_id"] = headers["x-aigw-rl-agent-key"]
        if headers.get("x-aigw-rl-lineage", "default") != "default":
            task["lineage"] = headers["x-aigw-rl-lineage"]
        tasks = load_tasks()
        # A repeated start on a session with an active Task answers that Task (CONTRACT §2.4), whatever lineage the
        # start asked for: what an RL Service that does not compare lineages would answer, so the gateway's own
        # check of the answered record is what the tests see.
        for other in tasks.values():
            if other["agent_session_id"] == task["agent_session_id"] and other["status"] == "active":
                self._answer(200, other)
                return
        tasks[task["rl_task_id"]] = task
        save_tasks(tasks)
        self._answer(201, task)

    def _hook(self, hook, body):
        task = load_tasks().get(body.get("rl_task_id")) if isinstance(body, dict) else None
        if task is None or task["status"] != "active":
            self._answer(404, {"error": {"code": "task_not_active", "message": "fake child"}})
        elif hook == "before":
            self._answer(200, {"request": body["request"]})
        else:
            self._answer(200, {"status": "ok"})

    def log_message(self, *args):
        pass


http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["FAKE_CHILD_PORT"])), Child).serve_forever()
