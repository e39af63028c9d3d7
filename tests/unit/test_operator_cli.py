"""`openjiuwen-rl rl ...` against a scripted gateway (httpx.MockTransport): signing, paths and bodies, output,
error envelopes, key sources, cursor following and `train watch` (the clock and sleep are injected)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.cli import main as cli_main
from openjiuwen.agent_evolving.agent_rl.cli.operator import KEY_ENV, KEY_FILE_ENV, MODEL_ENV, URL_ENV, main
from openjiuwen.agent_evolving.agent_rl.gateway.auth.hmac_auth import HmacVerifier

KEY = b"k" * 32
HEX_KEY = "ab" * 32  # 64 hex digits: decoded to 32 bytes, as the gateway does


Reply = httpx.Response | Callable[[httpx.Request], httpx.Response]


class FakeGateway:
    """Answers (method, path) from scripted replies (a queue per route; the last one repeats) and checks every
    request's signature with a real verifier, as the gateway would."""

    def __init__(self, key: bytes = KEY) -> None:
        self.verifier = HmacVerifier(key)
        self.routes: dict[tuple[str, str], deque[Reply]] = {}
        self.requests: list[httpx.Request] = []

    def on(self, method: str, path: str, *replies: Reply) -> None:
        self.routes[(method, path)] = deque(replies)

    def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        body = request.read()
        # Version 3, over the method and target as sent: the CLI's signature must bind the route and the query.
        ok = self.verifier.verify_request(request.method, request.url.raw_path, request.headers, body,
                                          now_ms=time.time_ns() // 1_000_000)
        if not ok:
            return error(401, "invalid_signature", "missing or invalid signature")
        replies = self.routes.get((request.method, request.url.path))
        if not replies:
            return error(404, "request_failed", "Not Found")
        reply = replies.popleft() if len(replies) > 1 else replies[0]
        return reply(request) if callable(reply) else reply

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)


def ok(data: Any, status: int = 200) -> httpx.Response:
    return httpx.Response(status, json=data)


def error(status: int, code: str, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"code": code, "message": message}})


def run_cli(gw: FakeGateway, *argv: str, env: dict[str, str] | None = None, **kwargs: Any) -> int:
    environment = {KEY_ENV: KEY.decode()} if env is None else env
    return main(list(argv), env=environment, transport=gw.transport, **kwargs)


def task_record(status: str = "active", **extra: Any) -> dict[str, Any]:
    return {"rl_task_id": "t1", "agent_session_id": "s1", "model_id": "tiny", "policy_lora_name": "base",
            "policy_model": "tiny", "reward_mode": "terminal", "status": status,
            "created_at": "2025-01-01T00:00:00+00:00", "finished_at": None, "finish_reason": None, **extra}


def run_record(status: str, stage: str, steps: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"training_run_id": "run-0123456789ab", "status": status, "stage": stage, "sample_count": 2,
            "policy_versions": {"base": 2}, "created_at": "2025-01-01T00:00:00+00:00", "started_at": None,
            "finished_at": None, "lora_name": None, "lora_path": None, "failure_reason": None,
            "metrics": {"steps": len(steps or []), "step_metrics": steps or []}, **extra}


@pytest.fixture
def gw() -> FakeGateway:
    return FakeGateway()


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds

    def clock(self) -> float:
        return self.now


# ---------------------------------------------------------------------------------------------- keys and transport


def test_requests_are_signed_with_the_key_file(gw: FakeGateway, tmp_path: Path, capsys) -> None:
    key_file = tmp_path / "keys.json"
    key_file.write_bytes(orjson.dumps({"apiHmacKey": KEY.decode(), "insHmacKey": "i" * 32}))
    gw.on("GET", "/v1/rl/service", ok({"status": "running", "failure_reason": None}))
    assert run_cli(gw, "service", "status", "--key-file", str(key_file), env={}) == 0
    assert capsys.readouterr().out == "RL Service: running\n"
    request = gw.requests[0]
    assert request.url == httpx.URL("http://127.0.0.1:8080/v1/rl/service")
    assert request.content == b""


def test_key_and_url_from_the_environment(tmp_path: Path, capsys) -> None:
    gw = FakeGateway(key=bytes.fromhex(HEX_KEY))
    gw.on("POST", "/v1/rl/service/start", ok({"status": "running", "failure_reason": None}))
    env = {KEY_ENV: HEX_KEY, URL_ENV: "http://gw.example:9000/"}
    assert run_cli(gw, "service", "start", env=env) == 0
    assert gw.requests[0].url == httpx.URL("http://gw.example:9000/v1/rl/service/start")
    # A key file named by the environment works too; an explicit --key-file wins over the key string.
    key_file = tmp_path / "keys.json"
    key_file.write_bytes(orjson.dumps({"apiHmacKey": HEX_KEY}))
    assert run_cli(gw, "service", "start", env={KEY_FILE_ENV: str(key_file)}) == 0
    assert run_cli(gw, "service", "start", "--key-file", str(key_file), env={KEY_ENV: "z" * 32}) == 0
    assert run_cli(gw, "service", "start", env={KEY_ENV: "z" * 32}) == 1  # wrong key: the gateway says 401
    err = capsys.readouterr().err
    assert "error: 401 invalid_signature: missing or invalid signature (check the HMAC key" in err


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        ({}, [], "no HMAC key: pass --key-file FILE, or set OPENJIUWEN_RL_HMAC_KEY or OPENJIUWEN_RL_KEY_FILE"),
        ({KEY_ENV: "short"}, [], "OPENJIUWEN_RL_HMAC_KEY: must be 64 hex digits"),
        ({}, ["--key-file", "/nonexistent/keys.json"], "key file /nonexistent/keys.json: does not exist or is not a regular file"),
    ],
)
def test_key_problems_are_usage_errors(gw: FakeGateway, capsys, env, argv, message) -> None:
    assert run_cli(gw, "traj", "stats", *argv, env=env) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert "short" not in err.replace("OPENJIUWEN", "")  # the key string itself is never echoed
    assert gw.requests == []


def test_key_file_without_api_key(gw: FakeGateway, tmp_path: Path, capsys) -> None:
    key_file = tmp_path / "keys.json"
    key_file.write_bytes(b'{"insHmacKey": "x"}')
    assert run_cli(gw, "traj", "stats", "--key-file", str(key_file), env={}) == 2
    assert "neither apiHmacKey (the gateway's key file) nor agentHmacKey" in capsys.readouterr().err


def test_an_agent_key_file_signs_as_its_agent(tmp_path: Path, capsys) -> None:
    """An agent's own key file (openjiuwen-rl keys add-agent) signs with its key and names it in X-Key-Id."""
    agent_key = b"g" * 32
    gw = FakeGateway()
    gw.verifier = HmacVerifier(KEY, agent_keys={"support-bot": agent_key})
    gw.on("POST", "/v1/rl/tasks/t1/stop", ok({"rl_task_id": "t1", "status": "finalized"}))
    key_file = tmp_path / "support-bot.key.json"
    key_file.write_bytes(orjson.dumps({"agentKeyId": "support-bot", "agentHmacKey": agent_key.decode()}))
    assert run_cli(gw, "task", "stop", "t1", "--key-file", str(key_file), env={}) == 0
    assert gw.requests[0].headers["x-key-id"] == "support-bot"
    # The console login is the operator's: an agent key file cannot make one.
    assert run_cli(gw, "console", "url", "--key-file", str(key_file), env={}) == 2
    assert "the console login is signed with the operator key" in capsys.readouterr().err
    both = tmp_path / "both.json"
    both.write_bytes(orjson.dumps({"apiHmacKey": KEY.decode(), "agentKeyId": "a", "agentHmacKey": "g" * 32}))
    assert run_cli(gw, "task", "stop", "t1", "--key-file", str(both), env={}) == 2
    assert "holds both apiHmacKey and agentHmacKey" in capsys.readouterr().err


def test_unreachable_gateway(capsys) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    code = main(["service", "status"], env={KEY_ENV: KEY.decode()}, transport=httpx.MockTransport(refuse))
    assert code == 1
    assert capsys.readouterr().err == (
        "error: cannot reach the gateway at http://127.0.0.1:8080 (ConnectError: connection refused)\n")


def test_error_envelope_is_printed_and_exits_1(gw: FakeGateway, capsys) -> None:
    gw.on("POST", "/v1/rl/training/runs", error(409, "insufficient_samples", "pending samples 0 is below minimum 1"))
    assert run_cli(gw, "train", "start") == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "error: 409 insufficient_samples: pending samples 0 is below minimum 1\n"


def test_non_envelope_error_body(gw: FakeGateway, capsys) -> None:
    gw.on("GET", "/v1/rl/trajectories/stats", httpx.Response(502, text="Bad Gateway"))
    assert run_cli(gw, "traj", "stats") == 1
    assert capsys.readouterr().err == "error: 502 http_error: Bad Gateway\n"


def test_error_messages_and_listings_escape_control_characters(gw: FakeGateway, capsys) -> None:
    """Errors, cursors and table cells quote what the gateway, agents and models wrote (issue 28 item 6): one line
    each, nothing that drives the terminal; `--json` keeps the answer exact."""
    gw.on("POST", "/v1/rl/training/runs", error(409, "insufficient_samples", "no\n\x1b[2Jsamples\x9b31m"))
    assert run_cli(gw, "train", "start") == 1
    assert capsys.readouterr().err == "error: 409 insufficient_samples: no\\n\\x1b[2Jsamples\\x9b31m\n"
    rows = {"items": [task_record(agent_session_id="s\x1b]0;owned\x07", finish_reason="x\ry")],
            "next_cursor": "c\x1b[1A"}
    gw.on("GET", "/v1/rl/tasks", ok(rows))
    assert run_cli(gw, "task", "list") == 0
    captured = capsys.readouterr()
    assert "s\\x1b]0;owned\\x07" in captured.out and "x\\ry" in captured.out
    assert captured.err == "more: --cursor c\\x1b[1A (or --all)\n"
    assert not any(c in captured.out + captured.err for c in "\x1b\x07\x9b\r")
    assert run_cli(gw, "task", "list", "--json") == 0
    assert orjson.loads(capsys.readouterr().out) == rows


# ---------------------------------------------------------------------------------------------- commands


def test_task_commands(gw: FakeGateway, capsys) -> None:
    gw.on("POST", "/v1/rl/tasks/start", ok(task_record(reward_mode="delayed_feedback"), 201))
    gw.on("POST", "/v1/rl/tasks/t1/stop", ok(task_record("finalized", finish_reason="user_stopped")))
    gw.on("POST", "/v1/rl/tasks/t1/reward", ok({"sample_count": 3}))
    gw.on("GET", "/v1/rl/tasks/t1", ok(task_record("finalized", finish_reason="user_stopped")))
    gw.on("GET", "/v1/rl/tasks/t1/events", ok({"items": [
        {"id": "1-0", "at": "2025-01-01T00:00:00+00:00", "type": "created", "data": {"reward_mode": "terminal"}}]}))

    assert run_cli(gw, "task", "start", "--session", "s1", "--mode", "delayed_feedback") == 0
    start = gw.requests[-1]
    assert orjson.loads(start.content) == {"reward_mode": "delayed_feedback"}
    assert start.headers["x-agent-session-id"] == "s1"
    assert start.headers["content-type"] == "application/json"
    out = capsys.readouterr().out
    assert "task         t1\n" in out and "reward mode  delayed_feedback\n" in out
    assert "policy       base (model tiny)\n" in out

    assert run_cli(gw, "task", "stop", "t1") == 0
    assert "status       finalized (user_stopped)\n" in capsys.readouterr().out
    assert run_cli(gw, "task", "reward", "t1", "0.5") == 0
    assert orjson.loads(gw.requests[-1].content) == {"reward": 0.5}
    assert capsys.readouterr().out == "task t1: reward 0.5 recorded, 3 sample(s) published\n"
    assert run_cli(gw, "task", "get", "t1") == 0
    assert "finished     -\n" in capsys.readouterr().out
    assert run_cli(gw, "task", "events", "t1") == 0
    assert capsys.readouterr().out.startswith("2025-01-01T00:00:00+00:00  created")


def test_ids_are_one_path_segment(gw: FakeGateway, capsys) -> None:
    assert run_cli(gw, "task", "get", "../service") == 1
    assert gw.requests[0].url.raw_path == b"/v1/rl/tasks/..%2Fservice"
    assert "404 request_failed" in capsys.readouterr().err


def test_json_output_before_or_after_the_command(gw: FakeGateway, capsys) -> None:
    stats = {"total": 2, "by_status": {"pending": 2, "training": 0, "trained": 0, "failed": 0},
             "by_source": {"rail": 2}, "stale": 0, "expired_unrewarded": 0, "updated_at": "2025-01-01T00:00:00+00:00"}
    gw.on("GET", "/v1/rl/trajectories/stats", ok(stats))
    assert main(["--json", "traj", "stats"], env={KEY_ENV: KEY.decode()}, transport=gw.transport) == 0
    assert orjson.loads(capsys.readouterr().out) == stats
    assert run_cli(gw, "traj", "stats", "--json") == 0
    assert orjson.loads(capsys.readouterr().out) == stats
    assert run_cli(gw, "traj", "stats") == 0
    out = capsys.readouterr().out
    assert "total               2\n" in out
    assert "by status           pending 2, training 0, trained 0, failed 0\n" in out
    assert "by source           rail 2\n" in out


def test_traj_list_follows_next_cursor(gw: FakeGateway, capsys) -> None:
    def page(request: httpx.Request) -> httpx.Response:
        cursor = request.url.params.get("cursor")
        start = int(cursor) if cursor else 0
        items = [{"sample_id": f"tr:{i}", "status": "pending", "source": "rail", "session_id": "s",
                  "policy_version": "base", "created_at": "2025-01-01T00:00:00+00:00",
                  "sampling": None if i % 2 else {"temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.0}}
                 for i in range(start, min(start + 2, 5))]
        return ok({"items": items, "next_cursor": str(start + 2) if start + 2 < 5 else None})

    gw.on("GET", "/v1/rl/trajectories", page)
    assert run_cli(gw, "traj", "list", "--status", "pending", "--limit", "2") == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].split() == ["SAMPLE_ID", "STATUS", "SOURCE", "SESSION", "POLICY", "INSTANCE", "SAMPLING", "CREATED_AT"]
    assert len(lines) == 3
    assert lines[1].split()[4:9] == ["base", "-", "T", "0.7", "top_p"] and lines[2].split()[4:7] == ["base", "-", "-"]
    assert "more: --cursor 2 (or --all)" in captured.err
    assert dict(gw.requests[0].url.params) == {"limit": "2", "status": "pending"}

    assert run_cli(gw, "traj", "list", "--limit", "2", "--all", "--json") == 0
    listing = orjson.loads(capsys.readouterr().out)
    assert [i["sample_id"] for i in listing["items"]] == ["tr:0", "tr:1", "tr:2", "tr:3", "tr:4"]
    assert listing["next_cursor"] is None
    assert [r.url.params.get("cursor") for r in gw.requests[1:]] == [None, "2", "4"]


def test_task_and_run_listings_timeline_and_policy_report(gw: FakeGateway, capsys) -> None:
    gw.on("GET", "/v1/rl/tasks", ok({"items": [task_record("finalized", finish_reason="user_stopped")],
                                     "next_cursor": "c2"}))
    assert run_cli(gw, "task", "list", "--status", "finalized", "--limit", "1") == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines()[0].split() == ["TASK", "STATUS", "REASON", "MODE", "POLICY", "SESSION",
                                                     "CREATED_AT"]
    assert captured.out.splitlines()[1].split()[:3] == ["t1", "finalized", "user_stopped"]
    assert "more: --cursor c2 (or --all)" in captured.err
    assert dict(gw.requests[-1].url.params) == {"limit": "1", "status": "finalized"}

    gw.on("GET", "/v1/rl/training/runs", ok({"items": [run_record("succeeded", "activating", lora_name="tiny:v1")],
                                              "next_cursor": None}))
    assert run_cli(gw, "train", "list") == 0
    assert capsys.readouterr().out.splitlines()[1].split() == [
        "run-0123456789ab", "succeeded", "activating", "2", "tiny:v1", "2025-01-01T00:00:00+00:00"]
    gw.on("GET", "/v1/rl/training/runs/run-0123456789ab/events", ok({"items": [
        {"id": "1-0", "at": "2025-01-01T00:00:00+00:00", "type": "created", "data": {"sample_count": 2}}]}))
    assert run_cli(gw, "train", "events", "run-0123456789ab") == 0
    assert capsys.readouterr().out.split() == ["2025-01-01T00:00:00+00:00", "created", '{"sample_count":2}']

    gw.on("GET", "/v1/rl/policies", ok({"items": [
        {"policy_version": "base", "lora_name": None, "parent_version": None, "tasks": 3, "samples": 3,
         "reward": {"n": 3, "mean": 0.3, "ci95": [0.05, 0.55]}, "reward_sources": {"terminal": 3},
         "judge_agreement": None, "tokens_per_completion": 12.0,
         "completion_latency_ms": {"mean": 40.0, "p50": 30.0, "p95": 90.0}},
        {"policy_version": "tiny:v1", "lora_name": "tiny:v1", "parent_version": "base", "tasks": 2, "samples": 2,
         "reward": {"n": 2, "mean": 0.8, "ci95": None}, "reward_sources": {"judge": 2}, "judge_agreement": 0.9,
         "tokens_per_completion": 10.5, "completion_latency_ms": None}],
        "comparison": {"latest": "tiny:v1", "parent": "base", "reward_delta": 0.5, "ci95": [0.1, 0.9]}}))
    assert run_cli(gw, "policy", "report") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["VERSION", "PARENT", "TASKS", "SAMPLES", "REWARD"]
    assert lines[1].split() == ["base", "-", "3", "3", "0.300", "[0.050,", "0.550]", "terminal", "3", "-", "12.0",
                                "30", "90"]
    assert lines[2].split()[:5] == ["tiny:v1", "base", "2", "2", "0.800"]
    assert lines[3] == "tiny:v1 vs base: reward +0.500 (95% CI +0.100 .. +0.900)"


def test_traj_get_summary(gw: FakeGateway, capsys) -> None:
    gw.on("GET", "/v1/rl/trajectories/tr:0", ok({
        "sample_id": "tr:0", "status": "pending", "source": "rail", "session_id": "s", "rl_task_id": None,
        "policy_version": "base", "created_at": "2025-01-01T00:00:00+00:00",
        "sampling": {"temperature": 1.3, "top_p": 1.0, "top_k": 20, "min_p": 0.05, "presence_penalty": 0.0,
                     "frequency_penalty": 0.0, "repetition_penalty": 1.0},
        "judge": {"score": 0.8, "source": "judge", "tag": "prev_feedback"},
        "trajectory": {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "response_text": "hello"}}))
    assert run_cli(gw, "traj", "get", "tr:0") == 0
    out = capsys.readouterr().out
    assert "judge     score 0.8 (judge, tag prev_feedback)\n" in out
    assert "tokens    prompt 3, response 2\n" in out and "reply     hello\n" in out
    assert "sampling  T 1.3 top_k 20 min_p 0.05\n" in out
    # One segment, spelled as the route table fills it (common/wire/routes.py): `:` stays, `/` would be escaped.
    assert gw.requests[0].url.raw_path == b"/v1/rl/trajectories/tr:0"


def test_lora_commands(gw: FakeGateway, capsys) -> None:
    status = {"status": "active", "active_lora": {"lora_name": "tiny:v1", "lora_path": "/l/tiny/v1"},
              "instances": {"ready": 2, "failed": 0}}
    gw.on("GET", "/v1/loras/tiny", ok(status))
    gw.on("DELETE", "/v1/loras/tiny", httpx.Response(204))
    assert run_cli(gw, "lora", "status", "tiny") == 0
    assert capsys.readouterr().out == "tiny: active tiny:v1 (/l/tiny/v1); instances ready 2, failed 0\n"
    assert run_cli(gw, "lora", "status", env={KEY_ENV: KEY.decode(), MODEL_ENV: "tiny"}) == 0
    assert run_cli(gw, "lora", "status") == 2
    assert "name the model" in capsys.readouterr().err
    assert run_cli(gw, "lora", "delete", "tiny") == 0
    assert gw.requests[-1].method == "DELETE"
    assert "tiny: LoRA deactivated; new Tasks use the base model" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- train watch


def test_train_start_watch_prints_changes_and_steps(gw: FakeGateway, capsys) -> None:
    step = {"step": 1, "loss": 0.25, "kl": 0.001, "samples": 2}
    gw.on("POST", "/v1/rl/training/runs", ok(run_record("pending", "queued"), 201))
    gw.on("GET", "/v1/rl/training/runs/run-0123456789ab",
          ok(run_record("pending", "queued")),
          ok(run_record("running", "training")),
          ok(run_record("running", "training")),
          ok(run_record("running", "training", [step])),
          ok(run_record("running", "activating", [step], lora_name="tiny:v1", lora_path="/l/tiny/v1")),
          ok(run_record("succeeded", "activating", [step], lora_name="tiny:v1", lora_path="/l/tiny/v1")))
    fake = FakeTime()
    assert run_cli(gw, "train", "start", "--watch", "--interval", "0.5", sleep=fake.sleep, clock=fake.clock) == 0
    assert capsys.readouterr().out.splitlines() == [
        "run-0123456789ab: pending (stage queued, 2 samples)",
        "run-0123456789ab: running (stage training, 2 samples)",
        "  step 1: loss=0.25 kl=0.001 samples=2",
        "run-0123456789ab: running (stage activating, 2 samples)",
        "run-0123456789ab: succeeded (stage activating, 2 samples) lora tiny:v1 at /l/tiny/v1",
    ]
    assert fake.sleeps == [0.5] * 5


def test_train_start_watch_shows_the_created_run_before_steps_of_a_fast_run(gw: FakeGateway, capsys) -> None:
    step = {"step": 1, "loss": 0.25}
    gw.on("POST", "/v1/rl/training/runs", ok(run_record("pending", "queued"), 201))
    # The first poll already finds the run done, with its step recorded.
    gw.on("GET", "/v1/rl/training/runs/run-0123456789ab",
          ok(run_record("succeeded", "activating", [step], lora_name="tiny:v1", lora_path="/l/tiny/v1")))
    fake = FakeTime()
    assert run_cli(gw, "train", "start", "--watch", sleep=fake.sleep, clock=fake.clock) == 0
    assert capsys.readouterr().out.splitlines() == [
        "run-0123456789ab: pending (stage queued, 2 samples)",
        "  step 1: loss=0.25",
        "run-0123456789ab: succeeded (stage activating, 2 samples) lora tiny:v1 at /l/tiny/v1",
    ]


@pytest.mark.parametrize("outcome", ["failed", "canceled"])
def test_watch_exits_1_when_the_run_did_not_succeed(gw: FakeGateway, capsys, outcome: str) -> None:
    gw.on("GET", "/v1/rl/training/runs/run-0123456789ab",
          ok(run_record("running", "training")),
          ok(run_record(outcome, "training", failure_reason="scripted training failure")))
    fake = FakeTime()
    assert run_cli(gw, "train", "watch", "run-0123456789ab", sleep=fake.sleep, clock=fake.clock) == 1
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"run-0123456789ab: {outcome} (stage training, 2 samples): scripted training failure")


def test_watch_json_prints_each_new_record(gw: FakeGateway, capsys) -> None:
    gw.on("GET", "/v1/rl/training/runs/run-0123456789ab",
          ok(run_record("running", "training")), ok(run_record("running", "training")),
          ok(run_record("succeeded", "activating")))
    fake = FakeTime()
    assert run_cli(gw, "train", "watch", "run-0123456789ab", "--json", sleep=fake.sleep, clock=fake.clock) == 0
    lines = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["status"] for r in lines] == ["running", "succeeded"]


def test_watch_tolerates_a_few_5xx_then_gives_up(gw: FakeGateway, capsys) -> None:
    unavailable = error(503, "rl_service_unavailable", "RL Service is not running")
    gw.on("GET", "/v1/rl/training/runs/run-0123456789ab",
          unavailable, ok(run_record("running", "training")), unavailable)
    fake = FakeTime()
    assert run_cli(gw, "train", "watch", "run-0123456789ab", sleep=fake.sleep, clock=fake.clock) == 1
    err = capsys.readouterr().err
    assert err.count("warning: polling run-0123456789ab: 503 rl_service_unavailable") == 6
    assert err.endswith("error: gave up watching run-0123456789ab after 5 failed polls\n")


def test_watch_unknown_run_and_timeout(gw: FakeGateway, capsys) -> None:
    assert run_cli(gw, "train", "watch", "run-ffffffffffff") == 1
    assert "error: 404 request_failed" in capsys.readouterr().err
    gw.on("GET", "/v1/rl/training/runs/run-0123456789ab", ok(run_record("running", "training")))
    fake = FakeTime()
    code = run_cli(gw, "train", "watch", "run-0123456789ab", "--watch-timeout", "3", sleep=fake.sleep,
                   clock=fake.clock)
    assert code == 1
    assert "error: run run-0123456789ab not finished after 3 s (it keeps running)" in capsys.readouterr().err
    assert fake.now == 3.0


def test_train_stop_and_get(gw: FakeGateway, capsys) -> None:
    gw.on("POST", "/v1/rl/training/runs/run-0123456789ab/stop", ok(run_record("canceled", "training")))
    gw.on("GET", "/v1/rl/training/runs/run-0123456789ab", ok(run_record("canceled", "training")))
    assert run_cli(gw, "train", "stop", "run-0123456789ab") == 0
    assert "status     canceled (stage training)\n" in capsys.readouterr().out
    assert run_cli(gw, "train", "get", "run-0123456789ab") == 0
    assert "samples    2 (base=2)\n" in capsys.readouterr().out
    report = {"tokens": 40, "temperatures": {"0.7": 1, "1.3": 1}, "truncated_samples": 1,
              "logprob_mismatch_mean": 0.0123, "logprob_mismatch_max": 0.25, "untruncated_mismatch_max": 2e-6,
              "ratio_clipped_share": 0.025, "correction": "ppo_clip"}
    trained = run_record("succeeded", "activating")
    trained["metrics"]["sampling"] = report
    gw.on("GET", "/v1/rl/training/runs/run-0123456789ab", ok(trained))
    assert run_cli(gw, "train", "get", "run-0123456789ab") == 0
    assert ("sampling   T 0.7×1, 1.3×1; truncated 1; |captured − recomputed| mean 0.012, max 0.25; ratios clipped "
            "2.5% (ppo_clip)\n") in capsys.readouterr().out
    # Issue 35: a run with constrained samples says how many it corrected and of which kinds.
    trained["metrics"]["sampling"] = dict(report, correction="ppo_clip+constrained_tis", constrained_samples=2)
    trained["metrics"]["constraints"] = {"json_schema": 2, "penalties": 1}
    gw.on("GET", "/v1/rl/training/runs/run-0123456789ab", ok(trained))
    assert run_cli(gw, "train", "get", "run-0123456789ab") == 0
    out = capsys.readouterr().out
    assert "2.5% (ppo_clip+constrained_tis); constrained 2\n" in out
    assert "shaped     json_schema×2, penalties×1\n" in out
    # Issue 38: the report's sample size, and where the run's time went.
    trained["metrics"]["sampling"] = dict(report, recomputed_samples=16)
    trained["metrics"]["timings"] = {"load": 7.92, "pi_old": 1.234, "publish": 0.08, "save": 0.16, "steps": 30.4}
    gw.on("GET", "/v1/rl/training/runs/run-0123456789ab", ok(trained))
    assert run_cli(gw, "train", "get", "run-0123456789ab") == 0
    out = capsys.readouterr().out
    assert "2.5% (ppo_clip); over 16 recomputed samples\n" in out
    assert "timings    load 7.9 s, pi_old 1.2 s, steps 30.4 s, save 0.2 s, publish 0.1 s\n" in out


# ---------------------------------------------------------------------------------------------- help and dispatch


@pytest.mark.parametrize("argv", [
    [], ["service"], ["service", "start"], ["task"], ["task", "start"], ["task", "reward"], ["train"],
    ["train", "start"], ["train", "watch"], ["lora"], ["lora", "status"], ["traj"], ["traj", "list"],
    ["task", "list"], ["train", "list"], ["train", "events"], ["policy"], ["policy", "report"],
])
def test_help_everywhere(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"], env={})
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage: openjiuwen-rl rl")


def test_usage_errors_exit_2(capsys) -> None:
    for argv in (["service"], ["task", "start"], ["task", "reward", "t1", "lots"], ["nope"]):
        with pytest.raises(SystemExit) as done:
            main(argv, env={})
        assert done.value.code == 2
    assert "the following arguments are required: --session" in capsys.readouterr().err


def test_registered_in_the_openjiuwen_rl_command(capsys) -> None:
    assert "rl" in cli_main.COMMANDS
    with pytest.raises(SystemExit) as done:
        cli_main.main(["rl", "traj", "--help"])
    assert done.value.code == 0
    assert "usage: openjiuwen-rl rl traj" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- lineages


def lineage_view(**extra: Any) -> dict[str, Any]:
    return {"lineage": "default", "line": "tiny", "paused": False, "paused_at": None,
            "training_policy": {"auto": True, "min_pending_samples": 8},
            "scheduler": {"pending_samples": 3, "eligible_samples": 3, "oldest_pending_at": None,
                          "oldest_wait_seconds": 12.5, "active_run": None, "rollout_deciding": False,
                          "last_run_ended_at": None, "eligible": False, "reason": "waiting",
                          "next_eligible_at": "2026-01-01T00:01:00+00:00"}, **extra}


def test_lineage_get_pause_resume_call_their_routes(gw: FakeGateway, capsys) -> None:
    gw.on("GET", "/v1/rl/lineages/default", ok(lineage_view()))
    gw.on("POST", "/v1/rl/lineages/default/pause", ok(lineage_view(paused=True, paused_at="2026-01-01T00:00:00Z")))
    gw.on("POST", "/v1/rl/lineages/support/resume", ok(lineage_view(lineage="support")))
    assert run_cli(gw, "lineage", "get") == 0
    out = capsys.readouterr().out
    assert "not eligible (waiting)" in out and "3 (3 eligible)" in out and "12.5 s" in out
    assert run_cli(gw, "lineage", "pause", "default") == 0
    assert "yes, since 2026-01-01T00:00:00Z" in capsys.readouterr().out
    assert run_cli(gw, "lineage", "resume", "support") == 0
    assert [(r.method, r.url.path) for r in gw.requests] == [
        ("GET", "/v1/rl/lineages/default"), ("POST", "/v1/rl/lineages/default/pause"),
        ("POST", "/v1/rl/lineages/support/resume")]


def test_lineage_not_found_is_an_error_answer(gw: FakeGateway, capsys) -> None:
    gw.on("POST", "/v1/rl/lineages/other/pause", error(404, "lineage_not_found", "lineage 'other' does not exist"))
    assert run_cli(gw, "lineage", "pause", "other") == 1
    assert "404 lineage_not_found" in capsys.readouterr().err


def test_train_get_shows_why_the_run_started(gw: FakeGateway, capsys) -> None:
    trigger = {"kind": "auto", "reason": "max_wait_seconds", "lineage": "default", "pending_samples": 5,
               "eligible_samples": 4, "oldest_wait_seconds": 61.2}
    gw.on("GET", "/v1/rl/training/runs/run-0123456789ab", ok(run_record("running", "training", trigger=trigger)))
    assert run_cli(gw, "train", "get", "run-0123456789ab") == 0
    assert "auto (max_wait_seconds: 4 eligible of 5 pending, oldest waited 61.2 s)" in capsys.readouterr().out


def test_train_get_shows_the_runs_freshness(gw: FakeGateway, capsys) -> None:
    fresh = {"eligible_at": "2025-01-01T00:00:00+00:00", "eligible_wait_seconds": 2.5, "policy_via": "promotion",
             "policy_at": "2025-01-01T00:05:00+00:00",
             "sample_to_policy_seconds": {"count": 2, "p50": 40.0, "p95": 71.5, "max": 71.5}}
    gw.on("GET", "/v1/rl/training/runs/run-0123456789ab", ok(run_record("succeeded", "activating", freshness=fresh)))
    assert run_cli(gw, "train", "get", "run-0123456789ab") == 0
    assert ("eligible → run 2.5 s, sample → policy p50 40.0 s / p95 71.5 s (promotion)"
            in capsys.readouterr().out)


def test_traj_exclude_posts_the_instance_and_says_what_moved(gw: FakeGateway, capsys) -> None:
    gw.on("POST", "/v1/rl/trajectories/exclude", ok(
        {"instance": "vllm-x", "excluded": 3, "training": 1, "excluded_instances": ["vllm-w", "vllm-x"]}))
    assert run_cli(gw, "traj", "exclude", "--instance", "vllm-x") == 0
    out = capsys.readouterr().out
    assert orjson.loads(gw.requests[0].read()) == {"instance": "vllm-x"}
    assert "instance vllm-x excluded: 3 sample(s) moved to `excluded`" in out
    assert "1 already in the running Training Run" in out and "excluded instances: vllm-w, vllm-x" in out


def test_traj_get_and_list_show_the_serving_instance(gw: FakeGateway, capsys) -> None:
    sample = {"sample_id": "c1", "status": "pending", "source": "rl_task", "session_id": "s", "rl_task_id": "t",
              "policy_version": "base", "created_at": "2025-01-01T00:00:00+00:00", "instance": "vllm-x",
              "trajectory": {"prompt_ids": [1], "response_ids": [2], "response_text": "hi"}}
    gw.on("GET", "/v1/rl/trajectories/c1", ok(sample))
    gw.on("GET", "/v1/rl/trajectories", ok({"items": [sample], "next_cursor": None}))
    assert run_cli(gw, "traj", "get", "c1") == 0
    assert "served    vllm-x\n" in capsys.readouterr().out
    assert run_cli(gw, "traj", "list") == 0
    assert capsys.readouterr().out.splitlines()[1].split()[5] == "vllm-x"


def test_traj_get_and_list_show_the_constraints_the_exclusion_and_the_choice(gw: FakeGateway, capsys) -> None:
    """Issue 35: what constrained a sample, why it is kept out of training, which choice of a group it is."""
    sampling = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.5,
                "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                "constraints": {"json_schema": {"name": "Answer", "bytes": 81}, "greedy": {}}}
    sample = {"sample_id": "c1.1", "status": "excluded", "source": "rl_task", "session_id": "s", "rl_task_id": "t",
              "policy_version": "base", "created_at": "2025-01-01T00:00:00+00:00", "sampling": sampling,
              "exclusion": {"reason": "constraint", "kinds": ["greedy"]}, "group_uid": "t:c1", "choice_index": 1,
              "trajectory": {"prompt_ids": [1], "response_ids": [2], "response_text": "hi"}}
    gw.on("GET", "/v1/rl/trajectories/c1.1", ok(sample))
    gw.on("GET", "/v1/rl/trajectories", ok({"items": [sample], "next_cursor": None}))
    assert run_cli(gw, "traj", "get", "c1.1") == 0
    out = capsys.readouterr().out
    assert "sampling  T 0 [json_schema, greedy]\n" in out
    assert "shaped    json_schema (name Answer, bytes 81); greedy\n" in out
    assert "training  excluded: constraint greedy\n" in out and "choice    1 of group t:c1\n" in out
    assert run_cli(gw, "traj", "list") == 0
    assert "T 0 [json_schema, greedy]" in capsys.readouterr().out


def test_lineage_options_and_lineage_list(gw: FakeGateway, capsys) -> None:
    gw.on("POST", "/v1/rl/training/runs", ok(run_record("queued", "queued", lineage="a"), 201))
    assert run_cli(gw, "train", "start", "--lineage", "a") == 0
    assert run_cli(gw, "train", "start") == 0
    bodies = [r.read() for r in gw.requests]
    assert bodies[0] == b'{"lineage":"a"}' and b"lineage" not in bodies[1]  # absent: the default lineage
    gw.on("GET", "/v1/rl/policies", ok({"items": [], "comparison": None}))
    assert run_cli(gw, "policy", "report", "--lineage", "a") == 0
    assert gw.requests[-1].url.params["lineage"] == "a"
    gw.on("GET", "/v1/rl/lineages", ok({"items": [
        {"lineage": "a", "line": "tiny:a", "first_used_at": "2026-01-01T00:00:00+00:00", "pending_samples": 4,
         "active_run": None}], "next_cursor": None}))
    capsys.readouterr()
    assert run_cli(gw, "lineage", "list", "--limit", "5") == 0
    assert gw.requests[-1].url.params["limit"] == "5"
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["LINEAGE", "LINE", "STATE", "PENDING", "ACTIVE_RUN", "FIRST_USED_AT"]
    assert lines[1].split() == ["a", "tiny:a", "live", "4", "-", "2026-01-01T00:00:00+00:00"]  # no state: live


def test_lineage_archive_restore_and_delete_call_their_routes(gw: FakeGateway, capsys) -> None:
    archived = lineage_view(lineage="a", line="tiny:a", state="archived", archived_at="2026-01-01T00:00:00Z",
                            archived_by="idle", restores_to="tiny:a:v3")
    gw.on("POST", "/v1/rl/lineages/a/archive", ok(archived))
    gw.on("POST", "/v1/rl/lineages/a/restore", ok(lineage_view(lineage="a", line="tiny:a", state="live")))
    assert run_cli(gw, "lineage", "archive", "a") == 0
    assert "archived since 2026-01-01T00:00:00Z (by idle; a restore serves tiny:a:v3 again)" in capsys.readouterr().out
    assert run_cli(gw, "lineage", "restore", "a") == 0
    assert "state          live" in capsys.readouterr().out
    deleting = lineage_view(lineage="a", line="tiny:a", state="deleting", deletion_started_at="2026-01-02T00:00:00Z",
                            remove_files=True)
    gw.on("POST", "/v1/rl/lineages/a/delete", ok(deleting, 202))
    gw.on("GET", "/v1/rl/lineages/a", ok(deleting), ok(deleting),
          error(404, "lineage_not_found", "lineage 'a' does not exist"))
    naps: list[float] = []
    assert run_cli(gw, "lineage", "delete", "a", "--remove-files", "--wait", "--interval", "0.5",
                   sleep=naps.append) == 0
    out = capsys.readouterr().out
    assert "being deleted since 2026-01-02T00:00:00Z (repository files removed)" in out
    assert out.rstrip().endswith("lineage a deleted") and naps == [0.5, 0.5, 0.5]
    assert [r.read() for r in gw.requests if r.url.path.endswith("/delete")] == [b'{"remove_files":true}']
    assert run_cli(gw, "lineage", "delete", "a") == 0  # no --wait: the request only
    assert gw.requests[-1].read() == b'{"remove_files":false}'
    gw.on("POST", "/v1/rl/lineages/default/archive", error(400, "lineage_protected", "never"))
    assert run_cli(gw, "lineage", "archive", "default") == 1
    assert "400 lineage_protected" in capsys.readouterr().err


def test_rollout_commands_name_a_lineage(gw: FakeGateway, capsys) -> None:
    """`--lineage` reaches the routes as `?lineage=` (status) and `{"lineage"}` (decisions); absent, the requests
    are exactly the default line's as before lineages."""
    record = {"rollout_id": "ro-0123456789ab", "kind": "canary", "status": "paused", "lineage": "a",
              "candidate": {"lora_name": "tiny:a:v1"}, "baseline": {"lora_name": "base"}}
    gw.on("GET", "/v1/rl/rollout", ok({"mode": "canary", "config": {}, "current": record, "recent": [],
                                       "lineage": "a"}))
    for action in ("promote", "rollback", "pause", "resume"):
        gw.on("POST", f"/v1/rl/rollout/{action}", ok(record))
    assert run_cli(gw, "rollout", "status", "--lineage", "a") == 0
    assert gw.requests[-1].url.params["lineage"] == "a"
    assert run_cli(gw, "rollout", "status") == 0
    assert "lineage" not in gw.requests[-1].url.params
    for action in ("promote", "rollback", "pause", "resume"):
        assert run_cli(gw, "rollout", action, "--lineage", "a") == 0
        assert gw.requests[-1].read() == b'{"lineage":"a"}'
        assert run_cli(gw, "rollout", action) == 0
        assert gw.requests[-1].read() == b""


def test_traj_list_and_stats_name_a_lineage(gw: FakeGateway, capsys) -> None:
    gw.on("GET", "/v1/rl/trajectories", ok({"items": [], "next_cursor": None}))
    gw.on("GET", "/v1/rl/trajectories/stats", ok({"total": 0, "by_status": {}, "by_source": {}}))
    assert run_cli(gw, "traj", "list", "--lineage", "support") == 0
    assert run_cli(gw, "traj", "stats", "--lineage", "support") == 0
    assert run_cli(gw, "traj", "list") == 0  # without it: the request as before lineages
    assert [(r.url.path, r.url.params.get("lineage")) for r in gw.requests] == [
        ("/v1/rl/trajectories", "support"), ("/v1/rl/trajectories/stats", "support"), ("/v1/rl/trajectories", None)]
