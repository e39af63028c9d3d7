"""Safe rollout end to end with real processes (docs/rollout.md): gateway + RL Service child (scripted trainer) +
private Redis + fake vLLM instances, agents through the official `openai` SDK, operator commands through the
installed CLI.

The environment is simulated by the test: a Task's reward depends only on the version that served its completion
(read from the answer's `model`), so a version "trained from inverted rewards" is simply one that earns less. The
decision loop never sees that table: it compares the arms from the Tasks' rewards alone.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.console.console_auth import login_token
from tests.support.fake_vllm import CHAT_PATH, FakeVLLM
from tests.support.gateway_process import API_KEY, GatewayProcess
from tests.support.invariants import check_invariants

pytestmark = pytest.mark.system

REPO_ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = REPO_ROOT / "test-artifacts" / "console"
QUALITY = {"tiny": 0.5, "tiny:v1": 0.2, "tiny:v2": 0.8}  # v1: the version trained from inverted rewards
JITTER = (-0.08, 0.0, 0.08, 0.04, -0.04)
DECISION_TIMEOUT_S = 90.0
CANARY = {"mode": "canary", "share": 0.5, "min_tasks": 6, "tolerance": 0.05, "failure_margin": 0.5,
          "max_duration_seconds": 3600, "decision_interval_seconds": 0.2}


@pytest.fixture
def vllm() -> Iterator[tuple[FakeVLLM, FakeVLLM]]:
    with FakeVLLM(served_model="tiny", name="vllm-a") as a, FakeVLLM(served_model="tiny", name="vllm-b") as b:
        yield a, b


class Env:
    """The agents and their (simulated) users: every Task is one completion, stopped and rewarded."""

    def __init__(self, gw: GatewayProcess, vllm: tuple[FakeVLLM, ...], quality: dict[str, float] = QUALITY) -> None:
        self.gw = gw
        self.quality = quality
        self.vllm = vllm
        self.client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        self.n = 0
        self.served: Counter[str] = Counter()
        self.rewarded = 0

    def task(self) -> str:
        self.n += 1
        session = f"user-{self.n}"
        started = self.gw.start_task(session)
        assert started.status_code == 201, started.text
        task = started.json()
        mark = [len(v.requests) for v in self.vllm]
        self.client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"q{self.n}"}], max_tokens=4,
            extra_headers={"X-Agent-Session-Id": session})
        sent = [r.body["model"] for v, m in zip(self.vllm, mark) for r in v.requests[m:] if r.path == CHAT_PATH]
        assert sent == [task["policy_model"]]  # served by the version the Task is pinned to
        served = sent[0]
        stopped = self.gw.signed("POST", f"/v1/rl/tasks/{task['rl_task_id']}/stop")
        assert stopped.status_code == 200, stopped.text
        reward = self.quality[served] + JITTER[self.n % len(JITTER)]
        r = self.gw.signed("POST", f"/v1/rl/tasks/{task['rl_task_id']}/reward", json={"reward": reward})
        assert r.status_code == 200, r.text
        self.served[served] += 1
        self.rewarded += 1
        self.last_task_id = task["rl_task_id"]
        return served

    def until_decided(self, *, batch: int = 4) -> dict[str, Any]:
        """Run Tasks until the current canary ends; returns its record."""
        deadline = time.monotonic() + DECISION_TIMEOUT_S
        while True:
            status = rollout(self.gw)
            if status["current"] is None:
                return status["recent"][0]
            assert time.monotonic() < deadline, f"no decision within {DECISION_TIMEOUT_S} s: {status}"
            for _ in range(batch):
                self.task()

    def train(self, lora_name: str) -> dict[str, Any]:
        r = self.gw.signed("POST", "/v1/rl/training/runs")
        assert r.status_code == 201, r.text
        run_id = r.json()["training_run_id"]
        deadline = time.monotonic() + 30
        while (run := self.gw.signed("GET", f"/v1/rl/training/runs/{run_id}").json())["status"] not in (
                "succeeded", "failed", "canceled"):
            assert time.monotonic() < deadline, run
            time.sleep(0.1)
        assert (run["status"], run["lora_name"]) == ("succeeded", lora_name), run
        return run


def rollout(gw: GatewayProcess) -> dict[str, Any]:
    r = gw.signed("GET", "/v1/rl/rollout")
    assert r.status_code == 200, r.text
    return r.json()


def lora(gw: GatewayProcess) -> dict[str, Any]:
    r = gw.signed("GET", "/v1/loras/tiny")
    assert r.status_code == 200, r.text
    return r.json()


def wait_current(gw: GatewayProcess, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (current := rollout(gw)["current"]) is None:
        assert time.monotonic() < deadline, "no rollout became current"
        time.sleep(0.1)
    return current


def cli(gw: GatewayProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "openjiuwen.agent_evolving.agent_rl.cli.main", "rl", *args,
         "--url", gw.url, "--key-file", str(gw.dir / "hmac.json")],
        capture_output=True, text=True, timeout=60, cwd=REPO_ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("OPENJIUWEN_RL_")},
    )


def console_rollout_page(gw: GatewayProcess) -> tuple[str, int, str, list[str]]:
    """The console's Rollout page in headless Chromium: its text, the chart's dots, the LoRA page's text, and any
    page problem."""
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "the Debian chromium package is missing: `make test` installs it"
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = browser.new_context(viewport={"width": 1360, "height": 900}).new_page()
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.on("console", lambda m: problems.append(m.text) if m.type in ("error", "warning") else None)
            page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
            token = login_token(API_KEY, expires_ms=int(time.time() * 1000) + 60_000)
            page.goto(f"{gw.url}/console/login#token={token}")
            page.wait_for_url(gw.url + "/console/")
            page.goto(f"{gw.url}/console/#/rollout")
            page.wait_for_selector('#view[data-route="/rollout"]', state="attached")
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "console-rollout.png"), full_page=True)
            rollout_text, dots = page.inner_text("#view"), page.locator("svg.chart circle.dot").count()
            page.goto(f"{gw.url}/console/#/loras")
            page.wait_for_selector('#view[data-route="/loras"]', state="attached")
            return rollout_text, dots, page.inner_text("#view"), problems
        finally:
            browser.close()


def sample_total(gw: GatewayProcess) -> int:
    """Every sample the service holds, whatever its status (trained ones included)."""
    return gw.signed("GET", "/v1/rl/trajectories/stats").json()["total"]


# ---------------------------------------------------------------------------------------------------- tests


async def test_bad_version_is_rolled_back_and_a_good_one_promoted(redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=list(vllm), rl_overrides={"rollout": CANARY}) as gw:
        gw.start_service()
        env = Env(gw, vllm)
        env.task()  # one rewarded sample on base to train from

        # The bad version: a candidate for half of the new Tasks, never for traffic outside a Task.
        env.train("tiny:v1")
        status = lora(gw)
        assert status["status"] == "base" and status["candidate"]["lora_name"] == "tiny:v1"
        assert all("tiny:v1" in v.loaded for v in vllm)
        refused = gw.signed("POST", "/v1/rl/training/runs")
        assert (refused.status_code, refused.json()["error"]["code"]) == (409, "rollout_in_progress")
        served = env.task()
        timeline = gw.signed("GET", f"/v1/rl/tasks/{env.last_task_id}/events").json()["items"]
        arm = [e["data"] for e in timeline if e["type"] == "rollout_arm"]
        expected = ("candidate", "tiny:v1") if served == "tiny:v1" else ("active", "base")
        assert [(a["arm"], a["lora_name"]) for a in arm] == [expected]

        record = env.until_decided()
        assert (record["status"], record["decision"]["reason"], record["decision"]["by"]) == (
            "rolled_back", "regression", "auto"), record
        arms = record["decision"]["arms"]
        assert arms["candidate"]["reward"]["n"] >= 6 and arms["active"]["reward"]["n"] >= 6
        assert record["decision"]["ci95"][1] < 0
        assert "candidate" not in lora(gw) and lora(gw)["status"] == "base"
        assert all("tiny:v1" not in v.loaded for v in vllm)  # unloaded: no Task is pinned to it any more
        assert {env.task() for _ in range(4)} == {"tiny"}  # every new Task on the active version
        run_events = [e["type"] for e in gw.signed(
            "GET", f"/v1/rl/training/runs/{record['training_run_id']}/events").json()["items"]]
        assert {"canary_started", "canary_rolled_back"} <= set(run_events)
        timeline = [e["type"] for e in gw.signed("GET", f"/v1/rl/rollout/{record['rollout_id']}/events").json()[
            "items"]]
        assert timeline == ["canary_started", "rollback_started", "canary_rolled_back"]

        # The good version: promoted, and then every new Task gets it.
        env.train("tiny:v2")
        record = env.until_decided()
        assert (record["status"], record["decision"]["reason"]) == ("promoted", "not_worse"), record
        assert record["decision"]["ci95"][0] >= -0.05
        assert lora(gw)["active_lora"]["lora_name"] == "tiny:v2" and "candidate" not in lora(gw)
        assert {env.task() for _ in range(3)} == {"tiny:v2"}
        metrics = gw.http.get("/metrics").text
        assert 'rl_rollout_decisions_total{action="rollback",by="auto",model_id="tiny",reason="regression"} 1.0' \
            in metrics
        assert sample_total(gw) == env.rewarded
        await check_invariants(redis, model_id="tiny", strict_active_index=True)


async def test_sigkill_of_service_and_gateway_mid_canary_loses_no_state_and_no_sample(
        redis, redis_url, tmp_path, vllm):
    with GatewayProcess(tmp_path, redis_url, instances=list(vllm), rl_overrides={"rollout": CANARY}) as gw:
        gw.start_service()
        env = Env(gw, vllm, {"tiny": 0.5, "tiny:v1": 0.8})
        env.task()
        env.train("tiny:v1")
        before = wait_current(gw)
        # Fewer Tasks than a decision needs (min_tasks per arm): the canary is still deciding.
        for _ in range(3):
            env.task()
        assert rollout(gw)["current"]["status"] == "running"
        await check_invariants(redis, model_id="tiny", strict_active_index=True)

        # SIGKILL the RL Service: the rollout record and every sample are in Redis.
        child = [int(p) for p in Path(f"/proc/{gw.proc.pid}/task/{gw.proc.pid}/children").read_text().split()]
        os.kill(child[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while gw.signed("GET", "/v1/rl/service").json()["status"] != "failed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        gw.start_service()
        after = rollout(gw)["current"]
        assert {k: after[k] for k in ("rollout_id", "status", "candidate", "baseline", "window_started_at")} == {
            k: before[k] for k in ("rollout_id", "status", "candidate", "baseline", "window_started_at")}
        arms = after["evaluation"]["arms"]
        assert arms["candidate"]["tasks"] + arms["active"]["tasks"] == 3
        assert sample_total(gw) == env.rewarded

        # SIGKILL the gateway (its child goes with it): the candidate comes back from its state file.
        gw.sigkill()
        gw.start()
        assert lora(gw)["candidate"]["lora_name"] == "tiny:v1"
        gw.start_service()
        assert rollout(gw)["current"]["rollout_id"] == before["rollout_id"]
        assert sample_total(gw) == env.rewarded
        await check_invariants(redis, model_id="tiny", strict_active_index=True)

        record = env.until_decided()
        assert record["status"] == "promoted", record
        assert lora(gw)["active_lora"]["lora_name"] == "tiny:v1"
        assert sample_total(gw) == env.rewarded
        await check_invariants(redis, model_id="tiny", strict_active_index=True)


async def test_manual_mode_waits_for_the_operator_and_the_cli_rolls_back_to_any_version(
        redis, redis_url, tmp_path, vllm):
    manual = {**CANARY, "mode": "manual"}
    with GatewayProcess(tmp_path, redis_url, instances=list(vllm), rl_overrides={"rollout": manual}) as gw:
        gw.start_service()
        env = Env(gw, vllm)
        env.task()
        env.train("tiny:v1")
        wait_current(gw)
        deadline = time.monotonic() + DECISION_TIMEOUT_S
        while (current := rollout(gw)["current"])["evaluation"]["action"] == "wait":
            assert time.monotonic() < deadline, current
            for _ in range(4):
                env.task()
        for _ in range(4):  # the loop has had rounds to act: manual never decides alone
            env.task()
        time.sleep(0.5)
        current = rollout(gw)["current"]
        assert current["status"] == "running" and current["evaluation"]["action"] == "rollback"
        shown = cli(gw, "rollout", "status")
        assert shown.returncode == 0 and "would" in shown.stdout and "regression" in shown.stdout, shown
        page, dots, loras_page, problems = await asyncio.to_thread(console_rollout_page, gw)
        assert "Would decide: rollback" in page and "regression" in page, page
        assert "candidate" in page and "tiny:v1" in page and "base" in page and "95% CI" in page
        assert dots == 2 and problems == []  # both arms' means with their intervals
        assert "canary candidate" in loras_page and "tiny:v1 for 50% of new Tasks" in loras_page, loras_page
        assert cli(gw, "rollout", "pause").returncode == 0
        assert rollout(gw)["current"]["status"] == "paused"
        promoted = cli(gw, "rollout", "promote")  # the operator overrides the recommendation
        assert promoted.returncode == 0, promoted.stderr
        assert lora(gw)["active_lora"]["lora_name"] == "tiny:v1"
        again = cli(gw, "rollout", "promote")
        assert again.returncode == 1 and "409 no_rollout" in again.stderr

        env.train("tiny:v2")
        wait_current(gw)
        assert cli(gw, "rollout", "rollback").returncode == 0
        assert lora(gw)["active_lora"]["lora_name"] == "tiny:v1" and "candidate" not in lora(gw)

        # Any published version, by name: forward to the rolled-back v2, then back to v1, then to base's child v1.
        for name in ("tiny:v2", "tiny:v1"):
            done = cli(gw, "lora", "activate", name)
            assert done.returncode == 0 and "activated" in done.stdout, (done.stdout, done.stderr)
            assert lora(gw)["active_lora"]["lora_name"] == name
            assert {env.task() for _ in range(2)} == {name}
        missing = cli(gw, "lora", "activate", "tiny:v9")
        assert missing.returncode == 1 and "404 lora_version_not_found" in missing.stderr
        same = cli(gw, "lora", "activate", "tiny:v1")
        assert same.returncode == 1 and "409 lora_already_active" in same.stderr
        kinds = [(r["kind"], r["status"]) for r in rollout(gw)["recent"]]
        assert kinds[:4] == [("activation", "activated"), ("activation", "activated"), ("canary", "rolled_back"),
                             ("canary", "promoted")]
        await check_invariants(redis, model_id="tiny", strict_active_index=True)

