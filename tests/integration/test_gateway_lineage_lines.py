"""Lines in the gateway's LoRA manager (docs/lineages.md "## Gateway"): each lineage's line switches, pins and persists
on its own, against fake vLLM instances on real sockets; the default line stays what it was."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.lora.lora_manager import LoraError, LoraManager
from openjiuwen.agent_evolving.agent_rl.gateway.lora.policy_lines import PolicyLines
from openjiuwen.agent_evolving.agent_rl.gateway.lora.lora_state_file import LoraStateFile
from tests.integration.test_gateway_lora_manager import managed
from tests.support.fake_vllm import FakeVLLM

MODEL = "tiny"
LINE = "tiny:support"


@pytest.fixture
def lora_root(tmp_path: Path) -> Path:
    root = tmp_path / "loras"
    for line in (MODEL, LINE):
        for n in (1, 2):
            (root / line.replace(":", "-") / f"v{n}").mkdir(parents=True)
    return root


def path(root: Path, line: str, n: int) -> str:
    return str(root / line.replace(":", "-") / f"v{n}")


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakeVLLM]]:
    instances = [FakeVLLM(served_model=MODEL, name=f"vllm-{c}") for c in "ab"]
    await asyncio.gather(*(f.astart() for f in instances))
    try:
        yield instances
    finally:
        await asyncio.gather(*(f.astop() for f in instances))


async def activate(loras: LoraManager, root: Path, line: str, n: int, expected: str) -> dict:
    return await loras.activate(base_model="/models/tiny", lora_name=f"{line}:v{n}", lora_path=path(root, line, n),
                                expected_lora_name=expected)


async def test_lines_switch_apart_and_default_line_is_unchanged(
    fakes: list[FakeVLLM], lora_root: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state.json"
    async with managed(fakes, lora_root, state) as loras:
        await activate(loras, lora_root, MODEL, 1, "base")
        await activate(loras, lora_root, LINE, 1, "base")
        await activate(loras, lora_root, LINE, 2, f"{LINE}:v1")
        # Each line's CAS is its own: the default line's v1 is not the expected version of the support line.
        with pytest.raises(LoraError) as refused:
            await activate(loras, lora_root, LINE, 1, f"{MODEL}:v1")
        assert refused.value.code == "lora_cas_conflict"

        assert loras.snapshot(MODEL) == (f"{MODEL}:v1", f"{MODEL}:v1")
        assert loras.snapshot(LINE) == (f"{LINE}:v2", f"{LINE}:v2")
        assert loras.snapshot("tiny:other") == ("base", MODEL)  # a line never used serves the base model
        assert loras.status(LINE)["active_lora"]["lora_name"] == f"{LINE}:v2"
        assert loras.status(LINE)["instances"] == {"ready": 2, "failed": 0}
        for fake in fakes:  # the support line's old version is unloaded, the default line's kept
            assert set(fake.loaded_paths) == {f"{MODEL}:v1", f"{LINE}:v2"}
        # The default line's entry is today's, byte for byte in form; the other line sits beside it.
        models = json.loads(state.read_text())["models"]
        assert set(models) == {MODEL, LINE}
        assert set(models[MODEL]) == {"lora_name", "lora_path", "base_model", "activated_at"}

        await loras.deactivate(LINE)
        assert loras.snapshot(LINE) == ("base", MODEL)
        assert loras.snapshot(MODEL) == (f"{MODEL}:v1", f"{MODEL}:v1")


async def test_every_lines_active_and_candidate_survive_a_restart(
    fakes: list[FakeVLLM], lora_root: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state.json"
    async with managed(fakes, lora_root, state) as loras:
        await activate(loras, lora_root, LINE, 1, "base")
        await loras.start_canary(base_model="/models/tiny", lora_name=f"{LINE}:v2", lora_path=path(lora_root, LINE, 2),
                                 expected_lora_name=f"{LINE}:v1", share=0.5)
        await activate(loras, lora_root, MODEL, 1, "base")

    async with managed(fakes, lora_root, state) as restarted:
        status = restarted.canary_status(LINE)
        assert status["active_lora"]["lora_name"] == f"{LINE}:v1"
        assert status["candidate"]["lora_name"] == f"{LINE}:v2"
        assert restarted.status(MODEL)["active_lora"]["lora_name"] == f"{MODEL}:v1"
        assert "candidate" not in restarted.status(MODEL)


async def test_a_state_file_of_another_line_key_is_refused(tmp_path: Path) -> None:
    """A version filed under a line it does not belong to is a corrupt file, never a guess."""
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"version": 1, "models": {
        LINE: {"lora_name": "tiny:v1", "lora_path": "/x", "base_model": "/m"}}}))
    with pytest.raises(LoraError) as refused:
        await LoraStateFile(state).read()
    assert refused.value.code == "invalid_lora_state"


def test_policy_lines_are_keyed_by_line() -> None:
    lines = PolicyLines()
    support = lines.of(LINE)
    assert (support.name, support.model) == (LINE, MODEL)
    assert lines.of_version(f"{LINE}:v3") is support
    assert lines.of_version(f"{MODEL}:v3") is None  # the default line was never used
    assert lines.of(MODEL).model == MODEL


async def test_retiring_a_line_drops_its_active_version_and_candidate_and_unloads_them(
    fakes: list[FakeVLLM], lora_root: Path, tmp_path: Path
) -> None:
    """A lineage archived or deleted (docs/lineages.md "Lifecycle"): one switch takes the line's active version and
    candidate out of serving, out of the state file and off the instances; the default line is untouched; a repeat
    is a no-op; a restart serves nothing of the line."""
    state = tmp_path / "state.json"
    async with managed(fakes, lora_root, state) as loras:
        await activate(loras, lora_root, MODEL, 1, "base")
        await activate(loras, lora_root, LINE, 1, "base")
        await loras.start_canary(base_model="/models/tiny", lora_name=f"{LINE}:v2", lora_path=path(lora_root, LINE, 2),
                                 expected_lora_name=f"{LINE}:v1", share=0.5)
        assert await loras.retire(LINE) == {"status": "retired", "line": LINE, "versions": [f"{LINE}:v1", f"{LINE}:v2"]}
        assert loras.snapshot(LINE) == ("base", MODEL)
        assert loras.canary_status(LINE)["candidate"] is None
        for fake in fakes:
            assert set(fake.loaded_paths) == {f"{MODEL}:v1"}
        document = json.loads(state.read_text())
        assert set(document["models"]) == {MODEL} and LINE not in document.get("candidates", {})
        assert await loras.retire(LINE) == {"status": "retired", "line": LINE, "versions": []}
        assert await loras.retire("tiny:never-used") == {"status": "retired", "line": "tiny:never-used",
                                                          "versions": []}
        assert loras.snapshot(MODEL) == (f"{MODEL}:v1", f"{MODEL}:v1")
    async with managed(fakes, lora_root, state) as restarted:
        assert restarted.snapshot(LINE) == ("base", MODEL)
