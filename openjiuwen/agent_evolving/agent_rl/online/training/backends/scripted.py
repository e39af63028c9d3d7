"""A deterministic backend for tests and system tests, selected only by `trainer_backend: scripted`.

What it does is read from a plan at every `train` call: `{"outcome": "succeed" | "fail" | "block",
"delay_seconds": float, "message": str, "drop": [sample ids], "steps": [step metrics], "sampling": {report}}`
(`steps` replaces the one all-zero step a success reports by default; `sampling` is the sampling report the run
records, as a PPO trainer measures it: ppo_math.sampling_report). The plan is a dict set by in-process tests, or a
JSON file (its path given at construction, from `ONLINE_RL_SCRIPTED_PLAN`) that system tests rewrite between runs.
`block` waits until the run is canceled. A success publishes a real repository version whose adapter files are
placeholders in PEFT's layout.
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

import orjson

from ...lora.repository import Artifact, LoraRepository
from . import OnProgress, TrainingCanceled, TrainingJob
from .common import artifact_metadata


def _empty_safetensors() -> bytes:
    header = b"{}"
    return struct.pack("<Q", len(header)) + header


class ScriptedBackend:
    name = "scripted"

    def __init__(self, repository: LoraRepository, *, plan_path: str | None = None) -> None:
        self._repository = repository
        self._plan_path = Path(plan_path) if plan_path else None
        self.plan: dict[str, Any] = {"outcome": "succeed"}
        self.calls: list[dict[str, Any]] = []
        self.health_error: str | None = None
        self._cancel_events: dict[str, asyncio.Event] = {}

    def _current_plan(self) -> dict[str, Any]:
        if self._plan_path is not None and self._plan_path.is_file():
            return orjson.loads(self._plan_path.read_bytes())
        return dict(self.plan)

    async def train(self, job: TrainingJob, *, on_progress: OnProgress) -> Artifact:
        training_run_id, samples = job.training_run_id, job.samples
        repository = self._repository.for_line(job.line)  # the version is the next of the job's line
        plan = await asyncio.to_thread(self._current_plan)
        self.calls.append({"training_run_id": training_run_id, "sample_ids": [s["sample_id"] for s in samples],
                           "init_lora_name": job.init_lora_name})
        cancel = self._cancel_events.setdefault(training_run_id, asyncio.Event())
        try:
            delay = float(plan.get("delay_seconds", 0))
            if delay:
                try:
                    await asyncio.wait_for(cancel.wait(), delay)
                    raise TrainingCanceled(f"run {training_run_id} canceled")
                except TimeoutError:
                    pass
            outcome = plan.get("outcome", "succeed")
            if outcome == "block":
                await cancel.wait()
                raise TrainingCanceled(f"run {training_run_id} canceled")
            if outcome == "fail":
                raise RuntimeError(plan.get("message", "scripted training failure"))
            steps = plan.get("steps") or [{"step": 1, "loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0,
                                           "tokens_per_second": 0.0, "samples": len(samples)}]
            for step in steps:
                await on_progress(dict(step))
            temp = await repository.create_temp(training_run_id)
            await asyncio.to_thread(self._write_adapter, temp)
            metrics = {"steps": len(steps), "step_metrics": [], "dropped_samples": len(plan.get("drop", [])),
                       "sampling": plan.get("sampling")}
            meta = artifact_metadata(job, trainer_backend=self.name, ppo_samples_per_step=0, metrics=metrics)
            meta["dropped_sample_ids"] = list(plan.get("drop", []))
            return await repository.publish(temp, meta)
        finally:
            self._cancel_events.pop(training_run_id, None)
            await repository.remove_temp(training_run_id)

    @staticmethod
    def _write_adapter(path: Path) -> None:
        (path / "adapter_config.json").write_bytes(
            orjson.dumps({"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": "all-linear"})
        )
        (path / "adapter_model.safetensors").write_bytes(_empty_safetensors())

    async def cancel(self, training_run_id: str) -> bool:
        event = self._cancel_events.get(training_run_id)
        if event is None:
            return False
        event.set()
        return True

    def check_health(self) -> None:
        if self.health_error:
            raise RuntimeError(self.health_error)

    async def close(self) -> None:
        for event in self._cancel_events.values():
            event.set()
