"""Captured training data stays private (issue 19, item 7): the trainer's root must be this user's alone, each run
writes into a fresh 0700 directory, and the batch, the spec, the LoRA metadata, the `active` marker and the logs are
0600 (adapter weights 0640 for a vLLM in the service's group). Nothing a run writes is readable by other users.

The "other user" is simulated with os.chown to uid 65534 (these tests may run as root); the real local backend
(torch + peft, a tiny random model, four samples) drives the run whose files are inspected while the worker runs.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from openjiuwen.agent_evolving.agent_rl.model_makers.tiny import make_tiny_model
from openjiuwen.agent_evolving.agent_rl.online.logs import ROOT_LOGGER, configure_logging
from openjiuwen.agent_evolving.agent_rl.online.lora.repository import LoraRepository
from openjiuwen.agent_evolving.agent_rl.common.private_files import UnsafeDirectoryError, ensure_private_root
from openjiuwen.agent_evolving.agent_rl.online.store.codec import PackedSample
from openjiuwen.agent_evolving.agent_rl.online.training.backends.local import LocalBackend
from openjiuwen.agent_evolving.agent_rl.online.training.ppo_settings import PPOSettings
from tests.support.fake_gateway import FakeGateway
from tests.support.service_app import MODEL_ID, make_config, running_app
from tests.support.runs import wait_for_run

OTHER_UID = 65534  # "nobody": any uid but ours
SAMPLES = 4


def modes(*roots: Path) -> dict[str, int]:
    """Every directory and file under `roots` (the roots too) → its permission bits."""
    out: dict[str, int] = {}
    for root in roots:
        if not root.exists():
            continue
        out[str(root)] = stat.S_IMODE(os.lstat(root).st_mode)
        for parent, dirs, files in os.walk(root):
            for name in dirs + files:
                path = os.path.join(parent, name)
                out[path] = stat.S_IMODE(os.lstat(path).st_mode)
    return out


def worker_umask(pid: int) -> int:
    """A live process's umask, from /proc (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise AssertionError(f"no Umask line for pid {pid}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """A tiny model and four samples drawn from it with their true logprobs."""
    from tests.support import learning as L

    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    base = L.load_model(model_dir)
    prompt = L.prompt_ids(model_dir)
    responses = L.sample_responses(base, prompt, SAMPLES, 4, seed=0)
    logprobs = [L.sequence_logprobs(base, prompt, r) for r in responses]
    return model_dir, L.documents(prompt, responses, logprobs, [float(i % 2) for i in range(SAMPLES)], MODEL_ID)


class SnoopingBackend(LocalBackend):
    """The real local backend; at the worker's first step it records the modes of everything written so far."""

    def __init__(self, *args: Any, watch: list[Path], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.watch = watch
        self.during: dict[str, int] = {}
        self.worker_umask: int | None = None

    async def train(self, job: Any, *, on_progress: Any) -> Any:
        async def snoop(metrics: dict[str, Any]) -> None:
            if not self.during:
                self.during = modes(*self.watch)  # the worker is still running: batch and spec are in place
                (proc,) = self._procs.values()
                self.worker_umask = worker_umask(proc.pid)
            await on_progress(metrics)

        return await super().train(job, on_progress=snoop)


async def run_once(redis_url: str, tmp: Path, model_dir: Path, docs: list[dict[str, Any]], train_root: Path):
    """One Training Run through the service with the snooping local backend: (run, backend)."""
    async with FakeGateway(model_id=MODEL_ID) as gateway:
        config = make_config(
            redis_url, tmp, aigw_endpoint=gateway.url, trainer_backend="local", base_model_path=str(model_dir),
            min_samples_for_training=SAMPLES, max_samples_per_run=SAMPLES, training_tmp_root=str(train_root),
            lora_activation_timeout=10.0, log_path=str(tmp / "logs" / "rl-service.log"),
        )
        backend = SnoopingBackend(
            LoraRepository(config.lora_repository_path, model_id=MODEL_ID),
            settings=PPOSettings(max_prompt_length=64, max_response_length=64), tmp_root=train_root,
            watch=[train_root, tmp / "loras"],
        )
        configure_logging(config)
        try:
            async with running_app(config, backend=backend) as (app, client):
                deps = app.state.deps
                await deps.samples.publisher.insert_if_absent([PackedSample.from_document(d) for d in docs])
                r = await client.post("/v1/rl/training/runs")
                assert r.status_code == 201, r.text
                return await wait_for_run(deps.runner, r.json()["training_run_id"]), backend
        finally:
            logger = logging.getLogger(ROOT_LOGGER)
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
                handler.close()


async def test_a_real_local_run_writes_only_private_files(redis, redis_url, tmp_path, tiny):
    model_dir, docs = tiny
    train_root = tmp_path / "train-tmp"
    run, backend = await run_once(redis_url, tmp_path, model_dir, docs, train_root)
    assert run.status == "succeeded", run.failure_reason

    during = backend.during
    assert stat.S_IMODE(os.stat(train_root).st_mode) == 0o700
    run_dirs = [Path(p) for p in during if Path(p).parent == train_root]
    assert len(run_dirs) == 1 and run_dirs[0].name.startswith(f"{run.training_run_id}-")  # fresh, from mkdtemp
    assert during[str(run_dirs[0])] == 0o700
    assert during[str(run_dirs[0] / "batch.json")] == 0o600  # captured prompts and completions
    assert during[str(run_dirs[0] / "spec.json")] == 0o600
    temp = [p for p in during if Path(p).name.startswith(".tmp-")]
    assert [during[p] for p in temp] == [0o700]  # the version being written
    assert not run_dirs[0].exists()  # removed after the run

    version = Path(run.lora_path)
    after = modes(version, version.parent / "active", tmp_path / "logs")
    assert after[str(version)] == 0o750
    assert after[str(version / "adapter_config.json")] == after[str(version / "adapter_model.safetensors")] == 0o640
    assert after[str(version / "metadata.json")] == 0o600
    assert after[str(version.parent / "active")] == 0o600
    assert after[str(tmp_path / "logs")] == 0o700
    assert after[str(tmp_path / "logs" / "rl-service.log")] == 0o600
    # Nothing written by the run, at any point, is open to other users: the trainer process writes with umask 077
    # (peft's model card, written and then removed, was 0o644 whenever the snapshot caught it).
    assert backend.worker_umask == 0o077
    everything = {**during, **after}
    assert {p: oct(m) for p, m in everything.items() if m & 0o007} == {}


@pytest.mark.parametrize("attack", ["created first by another user", "left writable by everyone"])
async def test_an_unsafe_training_root_fails_the_run_before_any_data_is_written(
    redis, redis_url, tmp_path, tiny, attack
):
    model_dir, docs = tiny
    train_root = tmp_path / "train-tmp"
    train_root.mkdir(mode=0o700)
    if attack == "created first by another user":
        os.chown(train_root, OTHER_UID, OTHER_UID)  # a local user made /tmp/agent_rl_online before the service
        expected = "belongs to another user (uid 65534"
    else:
        os.chmod(train_root, 0o777)  # anyone may rename the run directory and put their own spec.json in its place
        expected = "is writable by other users (mode 0777)"
    run, backend = await run_once(redis_url, tmp_path, model_dir, docs, train_root)
    assert run.status == "failed"
    assert expected in run.failure_reason and "training_tmp_root" in run.failure_reason, run.failure_reason
    assert backend.during == {}  # the worker never started
    assert os.listdir(train_root) == []  # and no batch was ever written there
    assert (os.stat(train_root).st_uid, stat.S_IMODE(os.stat(train_root).st_mode)) == (
        (OTHER_UID, 0o700) if attack == "created first by another user" else (os.geteuid(), 0o777))


def test_a_root_under_an_unsafe_parent_or_through_a_symlink_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # no sticky bit: another user could rename our root and put theirs in its place
    with pytest.raises(UnsafeDirectoryError, match="parent directory .*shared is writable by other users"):
        ensure_private_root(shared / "train-tmp")
    os.chmod(shared, 0o1777)  # like /tmp: others' entries cannot be renamed, so a private root inside is safe
    assert stat.S_IMODE(os.stat(ensure_private_root(shared / "train-tmp")).st_mode) == 0o700

    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UnsafeDirectoryError, match="is a symbolic link"):
        ensure_private_root(tmp_path / "link")

    owned = tmp_path / "owned-by-other"
    owned.mkdir()
    os.chown(owned, OTHER_UID, OTHER_UID)
    with pytest.raises(UnsafeDirectoryError, match="parent directory .*owned-by-other belongs to another user"):
        ensure_private_root(owned / "train-tmp")


def test_a_readable_root_of_our_own_is_narrowed_to_0700(tmp_path):
    root = tmp_path / "agent_rl_online"
    root.mkdir(mode=0o755)  # what earlier versions created
    os.chmod(root, 0o755)
    assert ensure_private_root(root) == root
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
