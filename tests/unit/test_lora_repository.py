"""The versioned LoRA repository (CONTRACT §4.8): atomic vN, temporaries never counted, no replacement."""

from __future__ import annotations

import threading
from pathlib import Path

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.online.lora.repository import Artifact, LoraRepository


def write_adapter(path: Path) -> None:
    (path / "adapter_config.json").write_text("{}")
    (path / "adapter_model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")


def test_publish_numbers_versions_and_writes_metadata(tmp_path):
    repo = LoraRepository(tmp_path, model_id="m")
    tmp = repo.create_temp_sync("run-000000000001")
    assert tmp.parent == tmp_path / "m" and tmp.name.startswith(".tmp-run-000000000001-")
    write_adapter(tmp)
    art = repo.publish_sync(tmp, {"training_run_id": "run-000000000001", "sample_count": 3})
    assert art.lora_name == "m:v1" and Path(art.lora_path) == (tmp_path / "m" / "v1").resolve()
    meta = orjson.loads((tmp_path / "m" / "v1" / "metadata.json").read_bytes())
    assert (meta["version"], meta["lora_name"], meta["model_id"], meta["user_id"], meta["sample_count"]) == (
        1, "m:v1", "m", "m", 3)
    assert not tmp.exists()
    tmp2 = repo.create_temp_sync("run-000000000002")
    write_adapter(tmp2)
    assert repo.publish_sync(tmp2, {}).lora_name == "m:v2"
    assert repo.complete_versions() == [1, 2]


def test_incomplete_and_temporary_directories_are_never_counted(tmp_path):
    repo = LoraRepository(tmp_path, model_id="m")
    (tmp_path / "m" / "v1").mkdir(parents=True)  # no metadata.json: incomplete
    (tmp_path / "m" / ".tmp-run-x-1").mkdir()
    (tmp_path / "m" / "v9").mkdir()
    (tmp_path / "m" / "v9" / "adapter_config.json").write_text("{}")
    assert repo.complete_versions() == []
    tmp = repo.create_temp_sync("run-000000000003")
    art = repo.publish_sync(tmp, {})
    # v1 exists (incomplete, empty): the rename never replaces it, so the next free number is taken.
    assert art.lora_name == "m:v2"
    assert (tmp_path / "m" / "v1").is_dir() and not any((tmp_path / "m" / "v1").iterdir())


def test_concurrent_publishers_never_collide(tmp_path):
    repo = LoraRepository(tmp_path, model_id="m")
    temps = [repo.create_temp_sync(f"run-00000000000{i}") for i in range(6)]
    results: list[Artifact] = []
    lock = threading.Lock()

    def go(path: Path) -> None:
        art = repo.publish_sync(path, {})
        with lock:
            results.append(art)

    threads = [threading.Thread(target=go, args=(t,)) for t in temps]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(a.lora_name for a in results) == [f"m:v{i}" for i in range(1, 7)]
    assert repo.complete_versions() == list(range(1, 7))


def test_remove_temp_and_active_marker(tmp_path):
    repo = LoraRepository(tmp_path, model_id="m")
    repo.create_temp_sync("run-aaaaaaaaaaaa")
    repo.create_temp_sync("run-aaaaaaaaaaaa")
    keep = repo.create_temp_sync("run-bbbbbbbbbbbb")
    assert repo.remove_temp_sync("run-aaaaaaaaaaaa") == 2
    assert keep.exists()
    active = tmp_path / "m" / "active"  # CONTRACT §4.8: read by operators, as a plain JSON file
    assert not active.exists()
    repo.write_active_sync("m:v1", "/x/m/v1", "run-aaaaaaaaaaaa")
    marker = orjson.loads(active.read_bytes())
    assert marker["lora_name"] == "m:v1" and marker["training_run_id"] == "run-aaaaaaaaaaaa"
    assert [p.name for p in (tmp_path / "m").iterdir() if p.name.startswith(".tmp-active")] == []


def test_validate_artifact(tmp_path):
    repo = LoraRepository(tmp_path, model_id="m")
    art = repo.publish_sync(repo.create_temp_sync("run-000000000001"), {})
    repo.validate_artifact(art)
    for bad in (
        Artifact("m:v2", art.lora_path), Artifact("other:v1", art.lora_path), Artifact("m:v0", art.lora_path),
        Artifact("m:v1", str(tmp_path / "elsewhere")),
    ):
        with pytest.raises(ValueError):
            repo.validate_artifact(bad)
    (Path(art.lora_path) / "metadata.json").unlink()
    with pytest.raises(ValueError):
        repo.validate_artifact(art)


def test_publish_refuses_foreign_directories(tmp_path):
    repo = LoraRepository(tmp_path, model_id="m")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    with pytest.raises(ValueError):
        repo.publish_sync(foreign, {})


def publish(repo: LoraRepository, run: str) -> Artifact:
    tmp = repo.create_temp_sync(run)
    write_adapter(tmp)
    return repo.publish_sync(tmp, {})


def test_a_retired_line_keeps_only_its_last_version_number_and_never_reuses_a_name(tmp_path):
    """A deleted lineage's files (docs/lineages.md "Lifecycle"): every version goes, the number of the last stays,
    so a lineage of the same name publishes v3 after v2, never a second v1 that a vLLM might still hold."""
    line = LoraRepository(tmp_path, model_id="m").for_line("m:a")
    for run in ("run-000000000001", "run-000000000002"):
        publish(line, run)
    line.create_temp_sync("run-000000000003")  # an interrupted run's temporary
    line.write_active_sync("m:a:v2", str(line.version_path(2)), "run-000000000002")
    outside = tmp_path / "outside"
    outside.mkdir()
    (line.model_dir / "planted").symlink_to(outside)  # a link in the directory: removed, never followed
    assert line.retire_sync() == 2
    assert [p.name for p in line.model_dir.iterdir()] == ["retired.json"] and outside.is_dir()
    assert line.complete_versions() == [] and line.retire_sync() == 2  # idempotent
    assert publish(line, "run-000000000004").lora_name == "m:a:v3"
    with pytest.raises(ValueError, match="default line"):
        LoraRepository(tmp_path, model_id="m").retire_sync()
    assert LoraRepository(tmp_path, model_id="m").for_line("m:never").retire_sync() == 0
