"""The `verl` backend: PPO with verl's FSDP engine in Ray actors (CONTRACT §7, D21).

Each run gets its own placement group (one bundle per rank: `ray_cpus_per_rank` CPUs and `ray_gpus_per_rank` GPUs,
or, with `training_gpu_ids`, a slot of those pinned GPUs) and its own `nproc_per_node` detached actors
(`training/verl/actor.py`) in namespace `online-rl-<key>`, rank 0 named `online_ppo_runner-<key>-<run id>` (others
`...-rank<i>`), `<key>` derived from the model id, so services of different models share a cluster safely and K
concurrent runs (`max_concurrent_runs`) never touch each other's actors: K runs on K GPUs. A run whose resources
are taken waits, and says so through `on_progress` (`{PLACEMENT: {"state": "waiting", ...}}`, then "placed").
The actors receive the claimed samples, the composed PPO config and the parent adapter's files; rank 0 returns
the trained adapter's PEFT files, which this process publishes through the repository like the local backend
does. A run's actors and group go when it ends (GPU memory goes back); an actor of this model's prefix that no
live run of this process owns (a crashed service's) is killed before a run is placed.

Ray is imported only when the first run starts, and no Ray call runs on the event loop: object refs are awaited
as futures, everything else in worker threads. Cancel kills that run's actors only; an actor that dies on its own
or a Ray connection that fails makes `check_health` raise until a later run starts its actors again.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...lora.repository import Artifact, LoraRepository
from ..adapter_files import ADAPTER_FILES
from ..ppo_settings import PPOSettings
from . import PLACEMENT, OnProgress, TrainingCanceled, TrainingJob
from .common import trained_metadata

log = logging.getLogger("openjiuwen.agent_rl.online.training.verl")

_KILL_WAIT_S = 30.0


def ray_key(model_id: str) -> str:
    """`<model id with characters outside [A-Za-z0-9_.-] replaced by _>-<8 hex of its SHA-256>` (CONTRACT §7)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", model_id)
    return f"{safe}-{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"


def ray_namespace(model_id: str) -> str:
    return f"online-rl-{ray_key(model_id)}"


def actor_prefix(model_id: str) -> str:
    return f"online_ppo_runner-{ray_key(model_id)}"


def actor_name(model_id: str, run_id: str, rank: int = 0) -> str:
    base = f"{actor_prefix(model_id)}-{run_id}"
    return base if rank == 0 else f"{base}-rank{rank}"


class PlacementError(RuntimeError):
    """The run's resources cannot be had: no node could ever hold a rank, or the wait passed its limit."""


@dataclass
class _Run:
    actors: list[Any] = field(default_factory=list)
    names: list[str] = field(default_factory=list)  # the actor names this run reserved (never swept)
    group: Any = None  # its placement group
    slot: int | None = None  # its slot of `training_gpu_ids`
    bundle: dict[str, float] = field(default_factory=dict)
    waited_s: float = 0.0
    done: asyncio.Future[Any] | None = None
    canceled: bool = False


def _short(exc: BaseException) -> str:
    """The last meaningful line of a (Ray-wrapped) error: a traceback does not belong in `failure_reason`."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:500]


def fits(bundle: dict[str, float], count: int, nodes: Sequence[dict[str, float]]) -> bool:
    """Whether `count` bundles could ever be placed on `nodes` (their total resources, busy or not): each bundle on
    one node, greedily packed. False means the run would wait forever."""
    room = [dict(node) for node in nodes]
    for _ in range(count):
        node = next((n for n in room if all(n.get(k, 0.0) >= v for k, v in bundle.items())), None)
        if node is None:
            return False
        for k, v in bundle.items():
            node[k] -= v
    return True


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
        gpus_per_rank: float | None = None,
        cpus_per_rank: float = 1.0,
        placement_timeout_s: float | None = None,
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
        if self._gpu_ids and gpus_per_rank is not None:
            raise ValueError("ray_gpus_per_rank: must be null when training_gpu_ids pins the GPUs")
        # Pinned GPUs are cut into slots of `nproc_per_node` ids: one live run per slot, the others wait.
        self._free_slots = list(range(len(self._gpu_ids) // nproc_per_node)) if self._gpu_ids else []
        self._slot_freed = asyncio.Event()
        self._visible_env = visible_devices_env
        self._gpus_per_rank, self._cpus_per_rank = gpus_per_rank, cpus_per_rank
        self._placement_timeout_s = placement_timeout_s
        self._tmp_root = str(tmp_root)
        self._ray_init_kwargs = dict(ray_init_kwargs or {})
        self._progress_interval_s = progress_interval_s
        self.namespace = ray_namespace(model_id)
        self._runs: dict[str, _Run] = {}
        self._ray_lock = threading.Lock()  # connect, sweep and name reservation: one worker thread at a time
        self._reserved: set[str] = set()  # actor names of this process's live runs (under `_ray_lock`)
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

    def bundle(self, *, cluster_has_gpus: bool) -> dict[str, float]:
        """What one rank asks Ray for. Pinned GPUs are not Ray's to give: such a rank asks CPUs only."""
        bundle = {"CPU": float(self._cpus_per_rank)}
        gpus = self._gpus_per_rank if self._gpus_per_rank is not None else (1.0 if cluster_has_gpus else 0.0)
        if gpus and not self._gpu_ids:
            bundle["GPU"] = float(gpus)
        return bundle

    def _create_group(self, run_id: str, run: _Run) -> None:
        """Connect, sweep leftovers, reserve the run's actor names and ask for its placement group (worker thread)."""
        import ray
        from ray.util import placement_group

        with self._ray_lock:
            self._connect()
            self._sweep()
            nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
            run.bundle = self.bundle(cluster_has_gpus=any(node.get("GPU", 0) >= 1 for node in nodes))
            if not fits(run.bundle, self._nproc, nodes):
                raise PlacementError(
                    f"no Ray placement can ever hold this run: {self._nproc} rank(s) of {run.bundle} each "
                    f"(nproc_per_node, ray_cpus_per_rank, ray_gpus_per_rank) on nodes with {nodes}")
            run.names = [actor_name(self._model_id, run_id, rank) for rank in range(self._nproc)]
            self._reserved.update(run.names)
            # PACK: a run's ranks on one node where they fit. The group's lifetime is this process's Ray job:
            # if the service dies, Ray removes the group and with it the actors placed in it.
            run.group = placement_group([dict(run.bundle) for _ in range(self._nproc)], strategy="PACK",
                                        name=f"{actor_prefix(self._model_id)}-{run_id}")

    def _sweep(self) -> None:
        """Kill every actor of this model's prefix that no live run of this process reserved: a crashed service's
        (it may hold a GPU). Called under `_ray_lock`, before a run is placed."""
        import ray

        prefix = actor_prefix(self._model_id)
        leftovers = [entry["name"] for entry in ray.util.list_named_actors(all_namespaces=True)
                     if entry.get("namespace") == self.namespace and entry["name"] not in self._reserved
                     and (entry["name"] == prefix or entry["name"].startswith(prefix + "-"))]
        for name in leftovers:
            try:
                ray.kill(ray.get_actor(name, namespace=self.namespace), no_restart=True)
            except ValueError:
                continue  # gone meanwhile
            log.warning("killed leftover verl actor %s (no live run of this service owns it)", name)

    def _start_actors(self, run_id: str, run: _Run) -> None:
        """Start the run's actors in its group, each recorded in `run.actors` as soon as it exists, so whatever
        happens next (a cancel, an error) kills every actor this started."""
        import ray

        from ..verl.actor import PPORunner

        remote = ray.remote(PPORunner)
        for rank in range(self._nproc):
            if run.canceled:
                return
            run.actors.append(
                remote.options(**self.actor_options(run_id, rank, group=run.group, bundle=run.bundle,
                                                    slot=run.slot)).remote(
                    rank=rank, world_size=self._nproc, tmp_root=self._tmp_root
                )
            )

    def actor_options(self, run_id: str, rank: int, *, group: Any, bundle: dict[str, float],
                      slot: int | None = None) -> dict[str, Any]:
        """Ray options of rank `rank`: its bundle of the run's group. With `training_gpu_ids` the rank sees exactly
        GPU ids[slot × nproc + rank] (exported in the visible-devices variable; Ray leaves it alone for an actor
        that asks no GPU)."""
        options: dict[str, Any] = {
            "name": actor_name(self._model_id, run_id, rank), "namespace": self.namespace, "lifetime": "detached",
            "max_concurrency": 2,  # `progress` answers while `train` runs
            "max_restarts": 0, "num_cpus": bundle.get("CPU", 0.0),
        }
        if group is not None:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_bundle_index=rank)
        if bundle.get("GPU"):
            options["num_gpus"] = bundle["GPU"]
        if self._gpu_ids:
            assert slot is not None
            options["runtime_env"] = {"env_vars": {self._visible_env: self._gpu_ids[slot * self._nproc + rank]}}
        return options

    def _release(self, run: _Run) -> None:
        """Kill the run's actors and remove its group (worker thread); its names are free again."""
        import ray
        from ray.exceptions import RayError

        self._kill(run.actors)
        if run.group is not None:
            with suppress(RayError, ValueError):  # already gone with its job or node
                ray.util.remove_placement_group(run.group)
        with self._ray_lock:
            self._reserved.difference_update(run.names)

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
            meta["ray"] = {"namespace": self.namespace, "actor": actor_name(self._model_id, training_run_id),
                           "nproc": self._nproc, "bundle": run.bundle, "waited_seconds": round(run.waited_s, 3)}
            if run.slot is not None:
                meta["ray"]["gpu_ids"] = self._slot_ids(run.slot)
            return await repository.publish(output, meta)
        finally:
            self._runs.pop(training_run_id, None)
            await repository.remove_temp(training_run_id)

    def _slot_ids(self, slot: int) -> list[str]:
        return self._gpu_ids[slot * self._nproc:(slot + 1) * self._nproc]

    async def _execute(self, run_id: str, run: _Run, job: dict[str, Any], on_progress: OnProgress) -> dict[str, Any]:
        from ray.exceptions import RayActorError, RayError, RayTaskError

        prepared: asyncio.Future[None] | None = None
        try:
            await self._place(run_id, run, on_progress)
            prepared = asyncio.ensure_future(asyncio.to_thread(self._start_actors, run_id, run))
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
            if prepared is not None:
                run.canceled = run.canceled or not prepared.done()  # the thread stops before its next actor
                await asyncio.wait({prepared})  # then every actor it started is in run.actors
                if not prepared.cancelled():
                    prepared.exception()  # retrieved (raised above when it mattered)
            if run.done is not None and not run.done.done():
                run.done.cancel()
            if run.names or run.group is not None:
                await asyncio.to_thread(self._release, run)
            if run.slot is not None:
                self._free_slots.append(run.slot)
                self._slot_freed.set()  # wakes the runs waiting for a slot
                run.slot = None

    async def _place(self, run_id: str, run: _Run, on_progress: OnProgress) -> None:
        """Get the run's resources: a slot of the pinned GPUs (if any), then its placement group. While they are
        taken by other runs the run waits, and says so once (`waiting`); `placed` follows with the wait (the time
        spent waiting for a slot and for the group, not Ray's start-up)."""
        started = time.monotonic()
        waited = 0.0
        waiting = False

        async def still_waiting(what: str) -> None:
            nonlocal waiting
            if run.canceled:
                raise TrainingCanceled(f"run {run_id} canceled")
            so_far = waited + time.monotonic() - started
            if self._placement_timeout_s is not None and so_far > self._placement_timeout_s:
                raise PlacementError(f"no {what} for this run within ray_placement_timeout_seconds "
                                     f"({self._placement_timeout_s:g} s)")
            if not waiting:
                waiting = True
                log.info("training run %s waits for %s", run_id, what, extra={"training_run_id": run_id})
                note = {"state": "waiting", "waiting_for": what, "nproc": self._nproc, "live_runs": len(self._runs)}
                await on_progress({PLACEMENT: {**note, **({"bundle": run.bundle} if run.bundle else {})}})

        if self._gpu_ids:
            while not self._free_slots:
                await still_waiting("slot of training_gpu_ids")
                self._slot_freed.clear()
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), self._progress_interval_s)
            run.slot = self._free_slots.pop(0)
        waited = time.monotonic() - started
        group = asyncio.ensure_future(asyncio.to_thread(self._create_group, run_id, run))
        try:
            await asyncio.shield(group)  # the group it may create must reach `run.group`, whatever happens here
        finally:
            await asyncio.wait({group})
        started = time.monotonic()  # the group is asked for now: the wait for it starts here
        ready = asyncio.ensure_future(self._get(run.group.ready()))
        try:
            while not (await asyncio.wait({ready}, timeout=self._progress_interval_s))[0]:
                await still_waiting("Ray resources")
            ready.result()
        finally:
            ready.cancel()
        run.waited_s = waited + time.monotonic() - started
        note: dict[str, Any] = {"state": "placed", "waited_seconds": round(run.waited_s, 3), "bundle": run.bundle,
                                "nproc": self._nproc}
        if run.slot is not None:
            note["gpu_ids"] = self._slot_ids(run.slot)
        await on_progress({PLACEMENT: note})

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
        """Stop this run only: its actors are killed (its group goes when `_execute` ends); other runs go on."""
        run = self._runs.get(training_run_id)
        if run is None or not run.actors:
            if run is not None:
                run.canceled = True  # waiting or still starting: `_execute` stops at its next look
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
