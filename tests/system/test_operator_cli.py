"""`openjiuwen-rl rl ...` against real processes: the gateway, its RL Service child (scripted trainer), a private
Redis, a fake vLLM instance and a fake Judge. Also the rail uploader signing its batches for the gateway."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.cli.operator import KEY_FILE_ENV, URL_ENV, main
from openjiuwen.agent_evolving.agent_rl.common.signing_keys import SigningKey
from openjiuwen.agent_evolving.agent_rl.rail import RLOnlineRail, TrajectoryUploader
from tests.support.fake_judge import FakeJudge
from tests.support.fake_vllm import FakeVLLM
from tests.support.gateway_process import AGENT_KEYS, GatewayProcess

pytestmark = pytest.mark.system

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def vllm() -> Iterator[FakeVLLM]:
    with FakeVLLM(served_model="tiny", name="vllm-a") as fake:
        yield fake


@pytest.fixture
def gw(redis, redis_url: str, tmp_path: Path, vllm: FakeVLLM) -> Iterator[GatewayProcess]:
    with FakeJudge() as judge, GatewayProcess(tmp_path, redis_url, instances=[vllm], judge_url=judge.url) as gateway:
        yield gateway


class Operator:
    """Runs the CLI in-process with the gateway's key file and URL taken from the environment it is given."""

    def __init__(self, gw: GatewayProcess, capsys: pytest.CaptureFixture[str]) -> None:
        self.env = {KEY_FILE_ENV: str(gw.dir / "hmac.json"), URL_ENV: gw.url}
        self._capsys = capsys

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        code = main(list(argv), env=self.env)
        captured = self._capsys.readouterr()
        return code, captured.out, captured.err


def captured_completion(gw: GatewayProcess, session: str) -> None:
    r = httpx.post(gw.url + "/v1/chat/completions", headers={"X-Agent-Session-Id": session}, timeout=30,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text


async def upload_rail_session(gw: GatewayProcess, session: str) -> TrajectoryUploader:
    """Two steps with feedback between them, through the gateway's signed upload route, with an agent's own key."""
    key = SigningKey(AGENT_KEYS["agent-a"], "agent-a")
    async with TrajectoryUploader(endpoint=gw.url, sign_key=key, flush_interval_s=0.05) as uploader:
        rail = RLOnlineRail(uploader, session_id=session)
        for step in range(2):
            if step:
                rail.on_user_feedback("good, go on")
            await rail.on_step([{"role": "user", "content": f"q{step}"}], f"a{step}", [1, 2], [3, 4 + step],
                               [-0.5, -0.5])
        await rail.on_session_end()
    return uploader


def test_operator_workflow(gw: GatewayProcess, capsys: pytest.CaptureFixture[str]) -> None:
    rl = Operator(gw, capsys)
    assert rl("service", "status") == (0, "RL Service: stopped\n", "")
    code, _, err = rl("task", "start", "--session", "cli-1")
    assert code == 1 and err.startswith("error: 503 rl_service_unavailable: ")

    # The installed entry point, as an operator runs it (options after the command, key file from the flag).
    started = subprocess.run(
        [sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.cli.main", "rl", "service", "start",
         "--url", gw.url, "--key-file", str(gw.dir / "hmac.json")],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("OPENJIUWEN_RL_")},
    )
    assert (started.returncode, started.stdout) == (0, "RL Service: running\n"), started.stderr
    assert rl("service", "status") == (0, "RL Service: running\n", "")

    # Task: start, one captured completion, stop, reward.
    code, out, _ = rl("--json", "task", "start", "--session", "cli-1")
    assert code == 0, out
    task = orjson.loads(out)
    task_id = task["rl_task_id"]
    assert (task["status"], task["reward_mode"], task["policy_lora_name"]) == ("active", "terminal", "base")
    captured_completion(gw, "cli-1")
    code, out, _ = rl("task", "stop", task_id)
    assert code == 0 and "status       finalized (user_stopped)\n" in out
    assert rl("task", "reward", task_id, "1") == (0, f"task {task_id}: reward 1.0 recorded, 1 sample(s) published\n",
                                                 "")
    code, _, err = rl("task", "reward", task_id, "0.5")
    assert code == 1 and err.startswith("error: 409 reward_conflict: ")

    # Training with the scripted trainer: watched to the end, exit 0, the LoRA is active.
    code, out, _ = rl("train", "start", "--watch", "--interval", "0.1")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("run-") and lines[-1].startswith(lines[0].split(":")[0])
    assert ": succeeded (stage activating, 1 samples) lora tiny:v1 at " in lines[-1]
    assert any(line.startswith("  step 1: ") for line in lines)
    code, out, _ = rl("lora", "status", "tiny")
    assert code == 0 and out.startswith("tiny: active tiny:v1 (") and out.endswith("instances ready 1, failed 0\n")

    # rail-v1 samples uploaded through the gateway (signed), then the trajectory views.
    uploader = asyncio.run(upload_rail_session(gw, "rail-cli"))
    assert (uploader.metrics.samples_sent, uploader.metrics.dropped, uploader.metrics.failed) == (2, 0, 0)
    code, out, _ = rl("--json", "traj", "stats")
    stats = orjson.loads(out)
    assert stats["by_status"] == {"pending": 2, "training": 0, "trained": 1, "failed": 0}
    assert stats["by_source"] == {"rl_task": 1, "rail": 2} and stats["total"] == 3
    code, out, _ = rl("traj", "stats")
    assert "by status           pending 2, training 0, trained 1, failed 0\n" in out
    code, out, err = rl("traj", "list", "--all", "--limit", "1")
    rows = out.splitlines()
    assert code == 0 and len(rows) == 4 and err == ""
    assert [row.split()[0] for row in rows[1:3]] == ["rail-cli:0", "rail-cli:1"]
    assert rows[3].split()[1] == "trained"
    code, out, err = rl("traj", "list", "--status", "pending", "--limit", "1")
    assert len(out.splitlines()) == 2 and "more: --cursor " in err
    code, out, _ = rl("traj", "get", "rail-cli:0")
    assert code == 0 and "judge     score 0.8 (judge, tag prev_feedback)\n" in out

    # A failing run: watch exits non-zero with the reason; the samples are pending again.
    gw.set_plan({"outcome": "fail", "message": "scripted failure for the CLI"})
    code, out, _ = rl("train", "start", "--watch", "--interval", "0.1")
    assert code == 1
    assert out.splitlines()[-1].endswith(": failed (stage training, 2 samples): scripted failure for the CLI")
    code, out, _ = rl("--json", "traj", "stats")
    assert orjson.loads(out)["by_status"]["pending"] == 2

    # Roll back to the base model, then stop the service.
    assert rl("lora", "delete", "tiny")[0] == 0
    assert rl("lora", "status", "tiny") == (0, "tiny: base; instances ready 1, failed 0\n", "")
    assert rl("service", "stop") == (0, "RL Service: stopped\n", "")


def test_rail_example_through_the_gateway(gw: GatewayProcess, vllm: FakeVLLM,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """examples/rail_uploader.py as documented: the model called directly, the uploads signed for the gateway with
    the agent's own key file."""
    rl = Operator(gw, capsys)
    assert rl("service", "start")[0] == 0
    example = subprocess.run(
        [sys.executable, "examples/rail_uploader.py", "--url", gw.url,
         "--key-file", str(gw.agent_key_file("agent-a")), "--vllm", vllm.url, "--model", "tiny"],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),  # this checkout's package, not an installed one
    )
    assert example.returncode == 0, example.stdout + example.stderr
    assert "3 samples sent" in example.stdout and "0 lost, 0 not judged" in example.stdout
    session = example.stdout.splitlines()[0].split(":")[0]
    code, out, _ = rl("--json", "traj", "list", "--status", "pending")
    items = [i for i in orjson.loads(out)["items"] if i["session_id"] == session]
    assert [i["sample_id"] for i in items] == [f"{session}:{n}" for n in range(3)]
    details = [orjson.loads(rl("--json", "traj", "get", i["sample_id"])[1]) for i in items]
    assert [d["judge"]["tag"] for d in details] == ["prev_feedback", "prev_feedback", "session_done"]
    assert all(d["trajectory"]["prompt_ids"] and d["trajectory"]["response_ids"] for d in details)
    # The agent asked vLLM itself, with the flags that return token ids and logprobs.
    asked = [r.body for r in vllm.requests if (r.body or {}).get("return_token_ids")]
    assert len(asked) == 3 and all(body["logprobs"] is True for body in asked)
