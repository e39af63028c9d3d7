"""The Ray actor of the verl backend: one rank of verl's FSDP training engine, driven through one Training Run.

`VerlBackend` starts `nproc_per_node` of these per run (rank 0 named `online_ppo_runner-<key>`), calls `train` on
all of them and kills them afterwards. Each rank builds verl's `TrainingWorker` (FSDP engine + optimizer, LoRA from
the parent adapter or fresh), converts the claimed samples (`training/batch.py`, captured token ids never
re-tokenized) and runs the PPO steps (`engine.py`). Rank 0 returns the trained adapter as PEFT files (bytes), so the
service publishes it without a filesystem shared with the cluster. The process-group rendezvous is at rank 0's
node (`address`); gloo on a CPU-only node, NCCL (and gloo for CPU tensors) with GPUs.

Everything heavy is imported inside the methods: this module is importable by the service without torch.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
from pathlib import Path
from typing import Any

from ....common.private_files import make_run_dir, write_private


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class PPORunner:
    """One rank. Methods run in the actor's threads (max_concurrency 2): `progress` answers while `train` runs."""

    def __init__(self, *, rank: int, world_size: int, tmp_root: str) -> None:
        self._rank = rank
        self._world_size = world_size
        self._tmp_root = tmp_root
        self._steps: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    # --- cheap calls -----------------------------------------------------------------------------------------------

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the process-group rendezvous."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def progress(self, since: int) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._steps[since:])

    # --- the run ---------------------------------------------------------------------------------------------------

    def train(self, job: dict[str, Any], master_addr: str, master_port: int) -> dict[str, Any]:
        # Private (0700) under a root checked to be this user's alone: the job holds captured samples.
        run_dir = make_run_dir(self._tmp_root, f"{job['training_run_id']}-rank{self._rank}-")
        try:
            return self._train(job, run_dir, master_addr, master_port)
        finally:
            shutil.rmtree(run_dir, ignore_errors=True)  # the temporary run directory goes in every case

    def _train(self, job: dict[str, Any], run_dir: Path, master_addr: str, master_port: int) -> dict[str, Any]:
        os.environ.update(
            RANK=str(self._rank), WORLD_SIZE=str(self._world_size), LOCAL_RANK="0",
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
            HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
        )
        from .cpu_platform import activate_if_no_accelerator

        on_cpu = activate_if_no_accelerator()
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            # verl would pick "cpu:gloo,<device>:nccl"; on the CPU platform that string is invalid, so gloo alone.
            dist.init_process_group(
                backend="gloo" if on_cpu else "cpu:gloo,cuda:nccl", rank=self._rank, world_size=self._world_size,
                init_method=f"tcp://{master_addr}:{master_port}",
            )
        from omegaconf import OmegaConf

        from ..batch import convert_samples
        from ..ppo_math import run_record
        from ..ppo_settings import PPOSettings
        from .engine import PPOSteps, build_worker, export_adapter

        cfg = OmegaConf.create(job["config"])
        OmegaConf.update(cfg, "actor_rollout_ref.model.path", job["base_model_path"], merge=False)
        if job.get("init_lora_files"):
            parent = run_dir / "parent"
            parent.mkdir()
            for name, data in job["init_lora_files"].items():
                write_private(parent / Path(name).name, data)  # a bare file name: nothing outside the run dir
            OmegaConf.update(cfg, "actor_rollout_ref.model.lora_adapter_path", str(parent), merge=False)
        if on_cpu and cfg.actor_rollout_ref.actor.fsdp_config.get("mixed_precision") is None:
            # verl's default (bf16 params, fp32 reduce) fails in FSDP2's gloo gradient reduce; fp32 throughout.
            OmegaConf.update(cfg, "actor_rollout_ref.actor.fsdp_config.mixed_precision",
                             {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}, merge=False)
        settings = PPOSettings.from_dict(job["settings"])
        torch.manual_seed(settings.seed)
        worker = build_worker(cfg)
        tokenizer = worker.model_config.tokenizer
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        batch = convert_samples(
            job["samples"], pad_token_id=pad, max_prompt_length=settings.max_prompt_length,
            max_response_length=settings.max_response_length,
            filter_overlong_prompts=settings.filter_overlong_prompts,
            advantage_estimator=settings.advantage_estimator,
        )
        ppo = PPOSteps(worker, cfg, settings, batch, rank=self._rank, world_size=self._world_size,
                       record=self._record)
        steps = ppo.run()
        files = export_adapter(worker, run_dir / "adapter")  # collective: every rank; files on rank 0 only
        return {
            "adapter_files": files,
            "metrics": run_record(steps, batch.meta, ppo.sampling),
            "dropped_sample_ids": batch.dropped_sample_ids,
        }

    def _record(self, metrics: dict[str, Any]) -> None:
        with self._lock:
            self._steps.append(metrics)
