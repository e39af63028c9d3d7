"""The `local` backend: PPO with torch + peft in a child process (CONTRACT §7).

The service writes the batch and a spec (0600) into a fresh private directory `<training_tmp_root>/<run_id>-<random>/`
(0700, from mkdtemp, under a root checked to be this user's alone: common/private_files.py), starts
`python -m ...training.local_worker SPEC` in its own process group, reads one JSON line per event from its stdout
(`step` → `on_progress`, `done` → the result), then publishes the adapter the worker wrote into a repository
temporary directory. Cancel kills the process group. The temporary run directory is removed in every case.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from ...lora.repository import Artifact, LoraRepository
from ....common.private_files import make_run_dir, write_private
from ..ppo_settings import PPOSettings
from . import OnProgress, TrainingCanceled, TrainingJob
from .common import trained_metadata

log = logging.getLogger("openjiuwen.agent_rl.online.training.local")

WORKER_MODULE = "openjiuwen.agent_evolving.agent_rl.online.training.local_worker"
_STDERR_TAIL_LINES = 20


class LocalBackend:
    name = "local"

    def __init__(
        self,
        repository: LoraRepository,
        *,
        settings: PPOSettings,
        tmp_root: str | Path,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
    ) -> None:
        self._repository = repository
        self._settings = settings
        self._tmp_root = Path(tmp_root)
        self._python = python
        self._env = env
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._canceled: set[str] = set()

    async def train(self, job: TrainingJob, *, on_progress: OnProgress) -> Artifact:
        training_run_id = job.training_run_id
        repository = self._repository.for_line(job.line)  # the version is the next of the job's line
        run_dir: Path | None = None
        try:
            # Before anything else: an unsafe root fails the run with its reason, and nothing is written into it.
            run_dir = await asyncio.to_thread(make_run_dir, self._tmp_root, f"{training_run_id}-")
            output = await repository.create_temp(training_run_id)
            spec = {
                "training_run_id": training_run_id,
                "base_model_path": job.base_model_path,
                "init_lora_path": job.init_lora_path if job.from_lora else "",
                "parent_version": job.init_lora_name,  # whose captured logprobs are π_old (pi_old.py)
                "output_dir": str(output),
                "batch_path": str(run_dir / "batch.json"),
                "settings": self._settings.to_dict(),
            }
            await asyncio.to_thread(self._write_inputs, run_dir, spec, job.samples)
            result = await self._run_worker(training_run_id, run_dir / "spec.json", on_progress)
            meta = trained_metadata(job, result, settings=self._settings, trainer_backend=self.name)
            published = time.perf_counter()
            artifact = await repository.publish(output, meta)
            if isinstance(artifact.metadata.get("timings"), dict):  # the run record's split; metadata.json has the rest
                artifact.metadata["timings"]["publish"] = round(time.perf_counter() - published, 3)
            return artifact
        finally:
            self._canceled.discard(training_run_id)
            await repository.remove_temp(training_run_id)
            if run_dir is not None:
                await asyncio.to_thread(shutil.rmtree, run_dir, True)

    @staticmethod
    def _write_inputs(run_dir: Path, spec: dict[str, Any], samples: Sequence[dict[str, Any]]) -> None:
        write_private(run_dir / "batch.json", orjson.dumps(list(samples)))
        write_private(run_dir / "spec.json", orjson.dumps(spec))

    async def _run_worker(self, run_id: str, spec_path: Path, on_progress: OnProgress) -> dict[str, Any]:
        proc = await asyncio.create_subprocess_exec(
            self._python, "-m", WORKER_MODULE, str(spec_path),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group: cancel kills the worker and anything it started
            env=self._env,
        )
        self._procs[run_id] = proc
        stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        result: dict[str, Any] | None = None

        async def read_stderr() -> None:
            assert proc.stderr is not None
            async for line in proc.stderr:
                text = line.decode(errors="replace").rstrip()
                stderr_tail.append(text)
                log.debug("local trainer %s: %s", run_id, text)

        stderr_task = asyncio.create_task(read_stderr())
        try:
            assert proc.stdout is not None
            async for line in proc.stdout:
                try:
                    event = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # a stray print of a library, not one of our events
                if event.get("event") == "step":
                    await on_progress(event["metrics"])
                elif event.get("event") == "done":
                    result = event
            code = await proc.wait()
            await stderr_task
        except asyncio.CancelledError:
            self._kill(proc)
            raise
        finally:
            self._procs.pop(run_id, None)
        if run_id in self._canceled:
            raise TrainingCanceled(f"run {run_id} canceled")
        if code != 0 or result is None:
            tail = " | ".join(line for line in stderr_tail if line)[-1500:]
            raise RuntimeError(f"local trainer exited with code {code}: {tail}")
        return result

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def cancel(self, training_run_id: str) -> bool:
        proc = self._procs.get(training_run_id)
        if proc is None:
            return False
        self._canceled.add(training_run_id)
        self._kill(proc)
        await proc.wait()
        return True

    def check_health(self) -> None:
        return None  # each run gets a fresh process: a dead worker fails its run, not the backend

    async def close(self) -> None:
        for proc in list(self._procs.values()):
            self._kill(proc)
