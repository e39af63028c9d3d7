"""The `local` backend with one warm multi-tenant trainer process (`local.warm_trainer: true`, docs/training.md).

Everything around the trainer is the per-run backend's (backends/local.py): the private run directory, the batch and
spec files, the repository temporary directory, `publish` in the service. Instead of a fresh
`local_worker` per run, every run goes to one long-lived `warm_worker` child (started at the first run, in its own
process group) that keeps the base model loaded; runs in flight together are trained together (warm_group.py).

One reader task reads the trainer's stdout and hands each event to the run it names. When the trainer dies (a crash,
SIGKILL, out of memory), every run it held fails with its stderr tail, so the runner gives each batch back to its
line's pending set as for a dead per-run worker; the next run starts a new trainer. Cancel asks the trainer to drop
the run (at once when queued, else before its next PPO step) and waits for that; only if the trainer does not answer
within `cancel_grace_s` is the whole trainer killed (the other runs then fail and give their batches back too).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections import deque
from pathlib import Path
from typing import Any

import orjson

from ...lora.repository import LoraRepository
from ..ppo_settings import PPOSettings
from . import OnProgress, TrainingCanceled
from .local import LocalBackend

log = logging.getLogger("openjiuwen.agent_rl.online.training.warm_local")

WARM_MODULE = "openjiuwen.agent_evolving.agent_rl.online.training.warm_worker"
_STDERR_TAIL_LINES = 20
_GONE = "trainer_exited"  # the synthetic event each waiting run gets when the trainer process ends


class _Trainer:
    """One trainer process and the runs waiting on its events."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.waiters: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self.stderr_tail: deque[str] = deque(maxlen=_STDERR_TAIL_LINES)
        self.reader: asyncio.Task[None] | None = None
        self.closing = False  # killed by `close`: its end is no failure worth a warning

    def send(self, request: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(orjson.dumps(request) + b"\n")

    def kill(self) -> None:
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class WarmLocalBackend(LocalBackend):
    name = "local"

    def __init__(
        self,
        repository: LoraRepository,
        *,
        settings: PPOSettings,
        tmp_root: str | Path,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        max_group: int = 8,
        gather_s: float = 0.2,
        cancel_grace_s: float = 60.0,
    ) -> None:
        super().__init__(repository, settings=settings, tmp_root=tmp_root, python=python, env=env)
        self._max_group = max_group
        self._gather_s = gather_s
        self._cancel_grace_s = cancel_grace_s
        self._trainer: _Trainer | None = None
        self._start_lock = asyncio.Lock()
        self._done: dict[str, asyncio.Event] = {}  # set when a run's `_run_worker` has returned
        self.trainer_starts = 0

    @property
    def trainer_pid(self) -> int | None:
        t = self._trainer
        return t.proc.pid if t is not None and t.proc.returncode is None else None

    async def _ensure_trainer(self) -> _Trainer:
        async with self._start_lock:
            t = self._trainer
            if t is not None and t.proc.returncode is None and t.reader is not None and not t.reader.done():
                return t
            proc = await asyncio.create_subprocess_exec(
                self._python, "-m", WARM_MODULE, "--max-group", str(self._max_group), "--gather-s", str(self._gather_s),
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True,  # its own process group: a kill takes anything it started with it
                env=self._env,
            )
            t = _Trainer(proc)
            t.reader = asyncio.create_task(self._read(t))
            self._trainer = t
            self.trainer_starts += 1
            log.info("warm trainer started (pid %d)", proc.pid)
            return t

    async def _read(self, t: _Trainer) -> None:
        async def read_stderr() -> None:
            assert t.proc.stderr is not None
            async for line in t.proc.stderr:
                text = line.decode(errors="replace").rstrip()
                t.stderr_tail.append(text)
                log.debug("warm trainer: %s", text)

        stderr_task = asyncio.create_task(read_stderr())
        try:
            assert t.proc.stdout is not None
            async for line in t.proc.stdout:
                try:
                    event = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # a stray print of a library, not one of ours
                queue = t.waiters.get(str(event.get("run")))
                if queue is not None:
                    queue.put_nowait(event)
            code = await t.proc.wait()
            await stderr_task
        finally:
            stderr_task.cancel()
            tail = " | ".join(line for line in t.stderr_tail if line)[-1500:]
            code = t.proc.returncode
            for queue in t.waiters.values():  # every run it held fails; the runner gives the batches back
                queue.put_nowait({"event": _GONE, "error": f"warm trainer exited with code {code}: {tail}"})
            if code is not None and not t.closing:
                log.warning("warm trainer (pid %d) exited with code %s", t.proc.pid, code)

    async def _run_worker(self, run_id: str, spec_path: Path, on_progress: OnProgress) -> dict[str, Any]:
        t = await self._ensure_trainer()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        t.waiters[run_id] = queue
        self._done[run_id] = asyncio.Event()
        try:
            t.send({"op": "train", "run": run_id, "spec": str(spec_path)})
            while True:
                event = await queue.get()
                kind = event.get("event")
                if kind == "step":
                    await on_progress(event["metrics"])
                elif kind == "done":
                    if run_id in self._canceled:  # canceled as it finished: nothing of it is published
                        raise TrainingCanceled(f"run {run_id} canceled")
                    return event
                elif kind == "canceled":
                    raise TrainingCanceled(f"run {run_id} canceled")
                elif kind == "failed":
                    raise RuntimeError(f"warm trainer: {event.get('error')}")
                elif kind == _GONE:
                    if run_id in self._canceled:
                        raise TrainingCanceled(f"run {run_id} canceled")
                    raise RuntimeError(event["error"])
        except asyncio.CancelledError:
            if t.proc.returncode is None:  # the run's task is going away: the trainer must drop it too
                try:
                    t.send({"op": "cancel", "run": run_id})
                except (ConnectionError, RuntimeError):
                    pass
            raise
        finally:
            t.waiters.pop(run_id, None)
            self._done.pop(run_id).set()

    async def cancel(self, training_run_id: str) -> bool:
        t = self._trainer
        done = self._done.get(training_run_id)
        if t is None or done is None:
            return False
        self._canceled.add(training_run_id)
        try:
            t.send({"op": "cancel", "run": training_run_id})
        except (ConnectionError, RuntimeError):
            pass
        try:
            await asyncio.wait_for(done.wait(), self._cancel_grace_s)
        except TimeoutError:
            log.warning("warm trainer did not drop run %s within %.0f s: killing it (its other runs fail and give "
                        "their batches back)", training_run_id, self._cancel_grace_s)
            t.kill()
            await done.wait()
        return True

    def check_health(self) -> None:
        return None  # a dead trainer fails the runs it held and is started again by the next run

    async def close(self) -> None:
        t = self._trainer
        if t is None:
            return
        t.closing = True
        t.kill()
        if t.proc.stdin is not None:
            t.proc.stdin.close()
        await t.proc.wait()
        if t.reader is not None:
            await asyncio.gather(t.reader, return_exceptions=True)
