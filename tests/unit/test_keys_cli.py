"""`openjiuwen-rl keys init|add-agent` (cli/keys.py): fresh keys, files private to their owner (0600), an agent's own
key file that the gateway's key file matches, and refusals that leave every file as it was."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import orjson
import pytest

from openjiuwen.agent_evolving.agent_rl.cli.main import main
from openjiuwen.agent_evolving.agent_rl.common.signing_keys import KeyFileError, load_agent_key, load_signing_key
from openjiuwen.agent_evolving.agent_rl.gateway.config import gateway_config_from_mapping, load_hmac_keys


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def gateway_keys_as_loaded(path: Path):
    config = gateway_config_from_mapping({
        "global": {"hmacKeyFile": str(path)},
        "lora": {"root": "/srv/loras", "statePath": "/tmp/state.json"},
        "onlineRL": {"command": ["python"], "configPath": "/etc/rl.yaml", "modelId": "tiny"},
    })
    return asyncio.run(load_hmac_keys(config))


def test_init_writes_a_private_key_file_the_gateway_accepts(tmp_path: Path, capsys) -> None:
    path = tmp_path / "gateway-keys.json"
    assert main(["keys", "init", str(path)]) == 0
    assert mode(path) == 0o600
    document = orjson.loads(path.read_bytes())
    assert set(document) == {"apiHmacKey", "insHmacKey"} and document["apiHmacKey"] != document["insHmacKey"]
    keys = gateway_keys_as_loaded(path)
    assert len(keys.api) == len(keys.ins) == 32
    out = capsys.readouterr().out
    assert document["apiHmacKey"] not in out and document["insHmacKey"] not in out  # keys are never printed
    before = path.read_bytes()
    assert main(["keys", "init", str(path)]) == 2  # never over an existing file
    assert "already exists" in capsys.readouterr().err and path.read_bytes() == before


def test_add_agent_writes_the_agents_own_file_and_the_gateways_entry(tmp_path: Path, capsys) -> None:
    gateway = tmp_path / "gateway-keys.json"
    assert main(["keys", "init", str(gateway)]) == 0
    for key_id in ("support-bot", "sales.bot_2"):
        out = tmp_path / f"{key_id}.key.json"
        assert main(["keys", "add-agent", key_id, "--key-file", str(gateway), "--out", str(out)]) == 0
        assert mode(out) == 0o600 and mode(gateway) == 0o600
        assert set(orjson.loads(out.read_bytes())) == {"agentKeyId", "agentHmacKey"}  # its own key, nothing else
    keys = gateway_keys_as_loaded(gateway)
    assert sorted(keys.agents) == ["sales.bot_2", "support-bot"]
    agent = load_agent_key(str(tmp_path / "support-bot.key.json"))
    assert (agent.key_id, agent.key) == ("support-bot", keys.agents["support-bot"])
    assert keys.agents["support-bot"] not in (keys.api, keys.ins, keys.agents["sales.bot_2"])
    assert load_signing_key(str(gateway)).key_id is None  # the gateway's file still signs as the operator
    with pytest.raises(KeyFileError, match="gateway's \\(operator's\\) key file"):
        load_agent_key(str(gateway))  # and an agent process refuses it
    printed = capsys.readouterr().out
    assert orjson.loads(gateway.read_bytes())["agentHmacKeys"][0]["key"] not in printed


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["support-bot"], "already has an agent key 'support-bot'"),
        (["bad id"], "an agent key id must match"),
        (["new-bot", "--max-lineages", "-1"], "maxLineages: must be an integer in 0..1000000"),
        (["new-bot", "--out", "EXISTING"], "already exists"),
    ],
)
def test_add_agent_refusals_change_nothing(tmp_path: Path, capsys, argv: list[str], message: str) -> None:
    gateway = tmp_path / "gateway-keys.json"
    assert main(["keys", "init", str(gateway)]) == 0
    existing = tmp_path / "existing.json"
    assert main(["keys", "add-agent", "support-bot", "--key-file", str(gateway), "--out", str(existing)]) == 0
    before = gateway.read_bytes(), existing.read_bytes()
    capsys.readouterr()
    out = str(tmp_path / "new.key.json")
    args = [a.replace("EXISTING", str(existing)) for a in argv]
    if "--out" not in args:
        args += ["--out", out]
    assert main(["keys", "add-agent", *args, "--key-file", str(gateway)]) == 2
    assert message in capsys.readouterr().err
    assert (gateway.read_bytes(), existing.read_bytes()) == before
    assert not Path(out).exists()


def test_add_agent_with_a_lineage_cap_writes_max_lineages_the_gateway_loads(tmp_path: Path) -> None:
    gateway = tmp_path / "gateway-keys.json"
    assert main(["keys", "init", str(gateway)]) == 0
    assert main(["keys", "add-agent", "tenant-7", "--max-lineages", "50", "--key-file", str(gateway),
                 "--out", str(tmp_path / "t7.json")]) == 0
    assert main(["keys", "add-agent", "other", "--key-file", str(gateway), "--out", str(tmp_path / "o.json")]) == 0
    entries = orjson.loads(gateway.read_bytes())["agentHmacKeys"]
    assert [e.get("maxLineages") for e in entries] == [50, None]
    assert gateway_keys_as_loaded(gateway).agent_lineage_caps == {"tenant-7": 50}  # "other" has no cap of its own


def test_add_agent_needs_the_gateways_key_file(tmp_path: Path, capsys) -> None:
    agent_file = tmp_path / "agent.json"
    agent_file.write_bytes(orjson.dumps({"agentKeyId": "a", "agentHmacKey": "a7" * 32}))
    assert main(["keys", "add-agent", "b", "--key-file", str(agent_file), "--out", str(tmp_path / "b.json")]) == 2
    assert "is not the gateway's key file" in capsys.readouterr().err
