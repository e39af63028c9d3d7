"""The driver's signed calls that read one fact from the gateway or the RL Service, or publish a reward, and fail the
step when the answer is not the expected one. Shared by the rounds, the bad-version check and the lineage demos."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..common.wire import routes
from .failures import DemoFailed

Signed = Callable[..., Any]  # Stack.signed


class ServiceCalls:
    def __init__(self, signed: Signed, model_id: str) -> None:
        self.signed = signed
        self.model_id = model_id

    def active_policy(self) -> str | None:
        r = self.signed("GET", f"/v1/loras/{self.model_id}")
        if r.status_code != 200:
            raise DemoFailed(f"GET /v1/loras/{self.model_id} answered {r.status_code}: {r.text[:300]}")
        active = r.json().get("active_lora")
        return active["lora_name"] if active else None

    def publish_reward(self, task_id: str, reward: float) -> dict[str, Any]:
        """The Task's terminal reward, signed with the agents' key (as the agent that ran it would)."""
        rewarded = self.signed(*routes.TASK_REWARD.at(task_id), json_body={"reward": reward}, agent=True)
        if rewarded.status_code != 200:
            raise DemoFailed(f"Task {task_id} reward answered {rewarded.status_code}: {rewarded.text[:300]}")
        return rewarded.json()

    def rollout_status(self) -> dict[str, Any]:
        r = self.signed(*routes.ROLLOUT.at())
        if r.status_code != 200:
            raise DemoFailed(f"GET /v1/rl/rollout answered {r.status_code}: {r.text[:300]}")
        return r.json()

    def pending_samples(self) -> int:
        r = self.signed(*routes.TRAJECTORY_STATS.at())
        if r.status_code != 200:
            raise DemoFailed(f"GET /v1/rl/trajectories/stats answered {r.status_code}: {r.text[:300]}")
        return int(r.json()["by_status"]["pending"])

    def wait_candidate(self, lora_name: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """The canary of `lora_name` once it is current (the gateway has loaded the candidate)."""
        deadline = time.monotonic() + timeout_s
        while True:
            current = self.rollout_status()["current"]
            if current is not None and current.get("candidate", {}).get("lora_name") == lora_name:
                return current
            if time.monotonic() > deadline:
                raise DemoFailed(f"{lora_name} did not become the canary's candidate within {timeout_s:.0f} s "
                                 f"(current rollout: {current})")
            time.sleep(0.2)
