"""The `verl` backend: PPO with verl's FSDP engine in Ray actors (CONTRACT §7, D21).

Per run, `nproc_per_node` detached actors (`training/verl/actor.py`) start in namespace `online-rl-<key>`, rank 0
named `online_ppo_runner-<key>` (others `...-rank<i>`), `<key>` derived from the model id, so services of
different models share a cluster safely. They receive the claimed samples, the composed PPO config and the parent
adapter's files; rank 0 returns the trained adapter's PEFT files, which this process publishes through the
repository like the local backend does. The actors are killed after every run (GPU memory goes back), and a
leftover actor of the same name (a crashed service) is killed before a new run starts.

Ray is imported only when the first run starts, and no Ray call runs on the event loop: object refs are awaited
as futures, everything else in worker threads. Cancel kills the actors; an actor that dies on its own or a Ray
connection that fails makes `check_health` raise until a later run starts its actors again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...lora.repository import Artifact, LoraRepository
from ..adapter_files import ADAPTER_FILES
from ..ppo_settings import PPOSettings
from . import OnProgress, TrainingCanceled, TrainingJob
from .common import trained_metadata

log = logging.getLogger("openjiuwen.agent_rl.online.training.verl")

_KILL_WAIT_S = 30.0


def ray_key(model_id: str) -> str:
    """`<model id with characters outside [A-Za-z0-9_.-] replaced by _>-<8 hex of its SHA-256>` (CONTRACT §7)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", model_id)
    return f"{safe}-{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"


def ray_namespace(model_id: str) -> str:
    return f"online-rl-{ray_key(model_id)}"


def actor_name(model_id: str, rank: int = 0) -> str:
    base = f"online_ppo_runner-{ray_key(model_id)}"
    return base if rank == 0 else f"{base}-rank{rank}"


@dataclass
class _Run:
    actors: list[Any] = field(default_factory=list)
    done: asyncio.Future[Any] | None = None
    canceled: bool = False


def _short(exc: BaseException) -> str:
    """The last meaningful line of a (Ray-wrapped) error: a traceback does not belong in `failure_reason`."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:500]


class VerlBackend:
    name = "verl"

    def __init__(
        self,
        repository: LoraRepository,
        *,
        model_id: str,
        ppo_config: dict[str, Any],
        settings: PPOSettings,
        ray_address: str = "",
        nproc_per_node: int = 1,
        training_gpu_ids: str = "",
        visible_devices_env: str = "CUDA_VISIBLE_DEVICES",
        tmp_root: str | Path = "/tmp/agent_rl_online",
        ray_init_kwargs: dict[str, Any] | None = None,
        progress_interval_s: float = 1.0,
    ) -> None:
        self._repository, self._model_id = repository, model_id
        self._ppo_config, self._settings = ppo_config, settings
        self._ray_address, self._nproc = ray_address, nproc_per_node
        self._gpu_ids = [gpu for gpu in training_gpu_ids.split(",") if gpu]
        if self._gpu_ids and len(self._gpu_ids) < nproc_per_node:
            raise ValueError(
                f"training_gpu_ids: names {len(self._gpu_ids)} GPU(s), nproc_per_node {nproc_per_node} needs one each"
            )
        self._visible_env = visible_devices_env
        self._tmp_root = str(tmp_root)
        self._ray_init_kwargs = dict(ray_init_kwargs or {})
        self._progress_interval_s = progress_interval_s
        self.namespace = ray_namespace(model_id)
        self._runs: dict[str, _Run] = {}
        self._owns_ray = False
        self._failure: str | None = None

    # --- Ray plumbing (worker threads only) ------------------------------------------------------------------------

    def _connect(self) -> None:
        import ray

        if ray.is_initialized():
            return
        ray.init(
            address=self._ray_address or None, namespace=self.namespace, include_dashboard=False,
            log_to_driver=False, ignore_reinit_error=True, **self._ray_init_kwargs,
        )
        self._owns_ray = True

    def _prepare(self, run: _Run) -> None:
        """Connect, then start the run's actors, each recorded in `run.actors` as soon as it exists, so whatever
        happens next (a cancel, an error) kills every actor this started."""
        import ray

        from ..verl.actor import PPORunner

        self._connect()
        self._kill_named()  # a leftover of a crashed service holds the name (and maybe a GPU)
        gpus = ray.cluster_resources().get("GPU", 0) >= 1
        remote = ray.remote(PPORunner)
        for rank in range(self._nproc):
            if run.canceled:
                return
            run.actors.append(
                remote.options(**self.actor_options(rank, cluster_has_gpus=gpus)).remote(
                    rank=rank, world_size=self._nproc, tmp_root=self._tmp_root
                )
            )

    def actor_options(self, rank: int, *, cluster_has_gpus: bool) -> dict[str, Any]:
        """Ray options of rank `rank`. With `training_gpu_ids` the rank sees exactly GPU ids[rank] (exported in
        the visible-devices variable; Ray leaves it alone for an actor that asks no GPU); otherwise Ray assigns one
        GPU per rank when the cluster has any."""
        options: dict[str, Any] = {
            "name": actor_name(self._model_id, rank), "namespace": self.namespace, "lifetime": "detached",
            "max_concurrency": 2,  # `progress` answers while `train` runs
            "max_restarts": 0, "num_cpus": 1,
        }
        if self._gpu_ids:
            options["runtime_env"] = {"env_vars": {self._visible_env: self._gpu_ids[rank]}}
        elif cluster_has_gpus:
            options["num_gpus"] = 1
        return options

    def _kill_named(self) -> None:
        import ray

        for rank in range(self._nproc):
            name = actor_name(self._model_id, rank)
            try:
                ray.kill(ray.get_actor(name, namespace=self.namespace), no_restart=True)
            except ValueError:
                continue  # no actor of that name
            # The name is released asynchronously after the kill; a new actor cannot take it before.
            deadline = time.monotonic() + _KILL_WAIT_S
            while time.monotonic() < deadline:
                try:
                    ray.get_actor(name, namespace=self.namespace)
                except ValueError:
                    break
                time.sleep(0.1)  # a worker thread, never the event loop

    @staticmethod
    def _kill(actors: Sequence[Any]) -> None:
        import ray
        from ray.exceptions import RayError

        for actor in actors:
            with suppress(RayError):  # its node is gone: nothing left to stop
                ray.kill(actor, no_restart=True)

    @staticmethod
    async def _get(ref: Any) -> Any:
        return await asyncio.wrap_future(ref.future())

    # --- the interface ---------------------------------------------------------------------------------------------

    async def train(self, job: TrainingJob, *, on_progress: OnProgress) -> Artifact:
        training_run_id = job.training_run_id
        repository = self._repository.for_line(job.line)  # the version is the next of the job's line
        run = self._runs[training_run_id] = _Run()
        try:
            init_files = await asyncio.to_thread(self._read_adapter, Path(job.init_lora_path)) if job.from_lora else {}
            actor_job = {
                "training_run_id": training_run_id, "config": self._ppo_config, "base_model_path": job.base_model_path,
                "samples": list(job.samples), "settings": self._settings.to_dict(), "init_lora_files": init_files,
            }
            result = await self._execute(training_run_id, run, actor_job, on_progress)
            output = await repository.create_temp(training_run_id)
            await asyncio.to_thread(self._write_adapter, output, result["adapter_files"])
            meta = trained_metadata(job, result, settings=self._settings, trainer_backend=self.name)
            meta["ray"] = {"namespace": self.namespace, "actor": actor_name(self._model_id), "nproc": self._nproc}
            return await repository.publish(output, meta)
        finally:
            self._runs.pop(training_run_id, None)
            await repository.remove_temp(training_run_id)

    async def _execute(self, run_id: str, run: _Run, job: dict[str, Any], on_progress: OnProgress) -> dict[str, Any]:
        from ray.exceptions import RayActorError, RayError, RayTaskError

        prepared = asyncio.ensure_future(asyncio.to_thread(self._prepare, run))
        try:
            await asyncio.shield(prepared)  # a cancel of this task must not leave the thread starting actors unseen
            if run.canceled:  # stopped while the actors were starting
                raise TrainingCanceled(f"run {run_id} canceled")
            master_addr, master_port = await self._get(run.actors[0].address.remote())
            self._failure = None  # the cluster answers again
            refs = [actor.train.remote(job, master_addr, master_port) for actor in run.actors]
            run.done = asyncio.ensure_future(asyncio.gather(*(self._get(ref) for ref in refs)))
            results = await self._follow(run, on_progress)
            return results[0]
        except RayActorError as exc:
            if run.canceled:
                raise TrainingCanceled(f"run {run_id} canceled") from exc
            self._failure = f"verl trainer actor died: {_short(exc)}"
            raise RuntimeError(self._failure) from exc
        except RayTaskError as exc:  # an exception inside the training code: this run fails, the backend is fine
            if run.canceled:
                raise TrainingCanceled(f"run {run_id} canceled") from exc
            raise RuntimeError(f"verl trainer failed: {_short(exc)}") from exc
        except RayError as exc:  # the cluster itself (connection, scheduling)
            self._failure = f"ray: {_short(exc)}"
            raise RuntimeError(self._failure) from exc
        except ConnectionError as exc:  # ray.init could not reach `ray_address`
            self._failure = f"ray: cannot connect to {self._ray_address or 'a local Ray'}: {exc}"
            raise RuntimeError(self._failure) from exc
        finally:
            run.canceled = run.canceled or not prepared.done()  # the thread stops before its next actor
            await asyncio.wait({prepared})  # then every actor it started is in run.actors
            if not prepared.cancelled():
                prepared.exception()  # retrieved (raised above when it mattered)
            if run.done is not None and not run.done.done():
                run.done.cancel()
            await asyncio.to_thread(self._kill, run.actors)

    async def _follow(self, run: _Run, on_progress: OnProgress) -> list[dict[str, Any]]:
        """Await the ranks, forwarding rank 0's finished steps to `on_progress` as they come."""
        from ray.exceptions import RayError

        assert run.done is not None
        seen = 0
        while True:
            finished, _ = await asyncio.wait({run.done}, timeout=self._progress_interval_s)
            if finished:
                results = run.done.result()
                for metrics in results[0].get("metrics", {}).get("step_metrics", [])[seen:]:
                    await on_progress(metrics)
                return results
            try:
                new = await self._get(run.actors[0].progress.remote(seen))
            except RayError:
                continue  # the train refs report what happened to the actor
            for metrics in new:
                seen += 1
                await on_progress(metrics)

    @staticmethod
    def _read_adapter(path: Path) -> dict[str, bytes]:
        return {name: (path / name).read_bytes() for name in ADAPTER_FILES}

    @staticmethod
    def _write_adapter(output: Path, files: dict[str, bytes]) -> None:
        missing = [name for name in ADAPTER_FILES if name not in files]
        if missing:
            raise RuntimeError(f"verl trainer returned no {', '.join(missing)}")
        for name, data in files.items():
            (output / Path(name).name).write_bytes(data)  # a bare file name: nothing outside the temp dir

    async def cancel(self, training_run_id: str) -> bool:
        run = self._runs.get(training_run_id)
        if run is None or not run.actors:
            if run is not None:
                run.canceled = True  # still starting: `_execute` stops once the actors exist
            return False
        run.canceled = True
        await asyncio.to_thread(self._kill, run.actors)
        if run.done is not None:
            # The ranks' refs fail once the actors are really gone: that is "stopped for good". `wait` neither
            # raises the (expected) actor error nor cancels the future, which `_execute` still reads.
            await asyncio.wait({run.done}, timeout=_KILL_WAIT_S)
        return True

    def check_health(self) -> None:
        if self._failure is not None:
            raise RuntimeError(self._failure)

    async def close(self) -> None:
        actors = [actor for run in self._runs.values() for actor in run.actors]
        for run in self._runs.values():
            run.canceled = True
        if actors:
            await asyncio.to_thread(self._kill, actors)
        if self._owns_ray:
            import ray

            await asyncio.to_thread(ray.shutdown)
            self._owns_ray = False
