"""Gateway configuration (CONTRACT §3.1): Go durations, the AIGW JSON shape, and loading the HMAC keys (agent keys,
the key file's mode, one key per role)."""

from __future__ import annotations

import asyncio
import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.config import (
    GatewayConfig,
    GatewayConfigError,
    format_duration,
    gateway_config_from_mapping,
    load_gateway_config,
    load_hmac_keys,
    parse_duration,
)
from openjiuwen.agent_evolving.agent_rl.common.signing_keys import HmacKeys, decode_key, gateway_keys_from_document

API_KEY = "api-key-0123456789abcdef-SECRET-x"  # 33 characters: used as its UTF-8 bytes
INS_KEY_HEX = "9f" * 32  # 64 hex digits: decoded to 32 bytes
AGENT_KEY_HEX = "a7" * 32
OTHER_AGENT_KEY = "agent-key-two-0123456789-SECRET-z"


def write_keys(path: Path, document: Any, mode: int = 0o600) -> Path:
    """A key file as an operator must keep it: private to its owner (the gateway refuses anything else)."""
    path.write_text(document if isinstance(document, str) else json.dumps(document))
    os.chmod(path, mode)
    return path


def example(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    """The contract's production example values."""
    data: dict[str, Any] = {
        "global": {"listen": "127.0.0.1:8080", "hmacKeyFile": str(tmp_path / "keys.json")},
        "instances": [
            {"name": "vllm-0", "model": "tiny", "instanceIp": "127.0.0.1", "port": 8000},
            {"name": "vllm-1", "model": "tiny", "instanceIp": "::1", "port": "8001"},
        ],
        "lora": {"root": "/srv/loras", "statePath": str(tmp_path / "lora-state.json"), "operationTimeout": "60s"},
        "onlineRL": {
            "command": ["python", "-m", "openjiuwen.agent_evolving.agent_rl.online.service"],
            "configPath": "/etc/rl-service.yaml",
            "modelId": "tiny",
            "endpoint": "http://127.0.0.1:18081",
            "hookTimeout": "30s",
            "hookRetries": 2,
            "drainTimeout": "120s",
            "controlTimeout": "300s",
        },
    }
    data.update(overrides)
    return data


def error_of(data: Any) -> str:
    with pytest.raises(GatewayConfigError) as info:
        gateway_config_from_mapping(data)
    return str(info.value)


# --- durations ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("300ms", 0.3), ("30s", 30.0), ("2m", 120.0), ("1h", 3600.0), ("1m30s", 90.0), ("1.5s", 1.5),
        ("500us", 0.0005), ("500µs", 0.0005), ("250ns", 2.5e-7), ("1h2m3s4ms", 3723.004), (".5s", 0.5),
        ("+2s", 2.0), ("-1s", -1.0), ("0s", 0.0),
    ],
)
def test_parse_duration_valid(text: str, seconds: float):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize(
    "text", ["", "30", "0", "1.5", "s", "-", "30 s", " 30s", "30s ", "30sec", "1d", "30S", "1m30", ".s", "1e3s",
             "ms", "--1s", "٣s"],
)
def test_parse_duration_invalid(text: str):
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize("seconds", [0.3, 30.0, 120.0, 0.0005, 1.5, 90.0])
def test_format_duration_round_trips(seconds: float):
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds)


# --- the config shape -----------------------------------------------------------------------------------------


def test_contract_example_parses(tmp_path: Path):
    config = gateway_config_from_mapping(example(tmp_path))
    assert (config.global_.listen_host, config.global_.listen_port) == ("127.0.0.1", 8080)
    assert config.global_.hmac_key_file == str(tmp_path / "keys.json") and config.global_.crypto_sock is None
    assert [(i.name, i.model, i.instance_ip, i.port) for i in config.instances] == [
        ("vllm-0", "tiny", "127.0.0.1", 8000), ("vllm-1", "tiny", "::1", 8001),
    ]
    assert [i.base_url for i in config.instances] == ["http://127.0.0.1:8000", "http://[::1]:8001"]
    assert config.lora.root == "/srv/loras" and config.lora.operation_timeout_s == 60.0
    rl = config.online_rl
    assert rl.command[-1] == "openjiuwen.agent_evolving.agent_rl.online.service"
    assert (rl.config_path, rl.endpoint) == ("/etc/rl-service.yaml", "http://127.0.0.1:18081")
    assert (rl.hook_timeout_s, rl.hook_retries, rl.drain_timeout_s, rl.control_timeout_s) == (30.0, 2, 120.0, 300.0)


def test_test_example_values_and_round_trip(tmp_path: Path):
    data = example(tmp_path)
    data["lora"]["operationTimeout"] = "5s"
    data["onlineRL"].update(hookTimeout="300ms", hookRetries=0, drainTimeout="300ms", controlTimeout="10s")
    config = gateway_config_from_mapping(data)
    assert (config.online_rl.hook_timeout_s, config.online_rl.drain_timeout_s) == (0.3, 0.3)
    assert config.lora.operation_timeout_s == 5.0 and config.online_rl.control_timeout_s == 10.0
    dumped = config.to_json()
    assert dumped["onlineRL"]["hookTimeout"] == "300ms" and dumped["lora"]["operationTimeout"] == "5s"
    assert gateway_config_from_mapping(json.loads(json.dumps(dumped))) == config


def test_defaults(tmp_path: Path):
    config = gateway_config_from_mapping({
        "global": {"cryptoSock": "/run/aigw/crypto.sock"},
        "lora": {"root": "/srv/loras", "statePath": "/var/lib/gw/lora.json"},
        "onlineRL": {"command": ["rl-service"], "configPath": "/etc/rl.yaml", "modelId": "tiny"},
    })
    assert config.global_.listen == "127.0.0.1:8080" and config.instances == []
    assert config.lora.operation_timeout_s == 60.0
    rl = config.online_rl
    assert (rl.endpoint, rl.hook_timeout_s, rl.hook_retries) == ("http://127.0.0.1:18081", 30.0, 2)
    assert (rl.drain_timeout_s, rl.control_timeout_s) == (120.0, 300.0)
    g = config.global_  # slow-client limits (issue 19, item 8)
    assert (g.header_timeout_s, g.keep_alive_timeout_s, g.max_connections) == (10.0, 5.0, 4096)


def test_slow_client_limits_parse_round_trip_and_refuse_nonsense(tmp_path: Path):
    data = example(tmp_path)
    data["global"].update(headerTimeout="1500ms", keepAliveTimeout="2s", maxConnections=64)
    config = gateway_config_from_mapping(data)
    assert (config.global_.header_timeout_s, config.global_.keep_alive_timeout_s) == (1.5, 2.0)
    dumped = config.to_json()["global"]
    assert (dumped["headerTimeout"], dumped["keepAliveTimeout"], dumped["maxConnections"]) == ("1500ms", "2s", 64)
    for key, value in (("headerTimeout", "0s"), ("headerTimeout", 10), ("keepAliveTimeout", "-1s"),
                       ("maxConnections", 8), ("maxConnections", "64"), ("maxConnections", True)):
        bad = example(tmp_path)
        bad["global"][key] = value
        with pytest.raises(GatewayConfigError, match=f"global.{key}"):
            gateway_config_from_mapping(bad)


def test_frozen(tmp_path: Path):
    config = gateway_config_from_mapping(example(tmp_path))
    with pytest.raises(Exception):
        config.online_rl.hook_retries = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    "path",
    [(), ("global",), ("instances", 0), ("lora",), ("onlineRL",)],
)
def test_unknown_keys_refused_at_every_level(tmp_path: Path, path: tuple):
    data = example(tmp_path)
    target: Any = data
    for part in path:
        target = target[part]
    target["surprise"] = 1
    where = ".".join(str(p) for p in (*path, "surprise"))
    assert f"{where}: unknown key" in error_of(data)


def test_snake_case_names_are_unknown(tmp_path: Path):
    data = example(tmp_path)
    data["onlineRL"]["hook_timeout"] = data["onlineRL"].pop("hookTimeout")
    assert "onlineRL.hook_timeout: unknown key" in error_of(data)


@pytest.mark.parametrize("sources", [{}, {"hmacKeyFile": "/k.json", "cryptoSock": "/c.sock"}])
def test_exactly_one_key_source(tmp_path: Path, sources: dict):
    data = example(tmp_path)
    data["global"] = {"listen": "127.0.0.1:8080", **sources}
    assert "exactly one of hmacKeyFile and cryptoSock" in error_of(data)


@pytest.mark.parametrize(
    ("section", "key", "value", "field"),
    [
        ("onlineRL", "hookTimeout", "30", "onlineRL.hookTimeout"),
        ("onlineRL", "hookTimeout", 30, "onlineRL.hookTimeout"),
        ("onlineRL", "drainTimeout", "0s", "onlineRL.drainTimeout"),
        ("onlineRL", "controlTimeout", "-1s", "onlineRL.controlTimeout"),
        ("onlineRL", "hookRetries", -1, "onlineRL.hookRetries"),
        ("onlineRL", "hookRetries", True, "onlineRL.hookRetries"),
        ("onlineRL", "hookRetries", "2", "onlineRL.hookRetries"),
        ("onlineRL", "command", [], "onlineRL.command"),
        ("onlineRL", "command", "python -m x", "onlineRL.command"),
        ("onlineRL", "command", ["python", " "], "onlineRL.command.1"),
        ("onlineRL", "endpoint", "http://10.0.0.5:18081", "onlineRL.endpoint"),
        ("onlineRL", "endpoint", "https://127.0.0.1:18081", "onlineRL.endpoint"),
        ("onlineRL", "endpoint", "http://127.0.0.1:18081/v1", "onlineRL.endpoint"),
        ("onlineRL", "endpoint", "http://localhost:18081", "onlineRL.endpoint"),
        ("onlineRL", "endpoint", "http://LOCALHOST:18081", "onlineRL.endpoint"),
        ("onlineRL", "endpoint", "http://ip6-localhost:18081", "onlineRL.endpoint"),
        ("onlineRL", "endpoint", "http://128.0.0.1:18081", "onlineRL.endpoint"),
        ("onlineRL", "configPath", "", "onlineRL.configPath"),
        ("lora", "root", "relative/loras", "lora.root"),
        ("lora", "operationTimeout", "1d", "lora.operationTimeout"),
        ("global", "listen", "8080", "global.listen"),
        ("global", "listen", "127.0.0.1:99999", "global.listen"),
        ("global", "listen", "::1:8080", "global.listen"),
    ],
)
def test_invalid_values_name_the_field(tmp_path: Path, section: str, key: str, value: Any, field: str):
    data = example(tmp_path)
    data[section][key] = value
    message = error_of(data)
    assert message.startswith(f"gateway config: {field}: "), message


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:18081", "http://[::1]:18081", "http://127.0.0.2:18081/"])
def test_the_rl_endpoint_is_an_ip_literal_of_loopback(tmp_path: Path, endpoint: str):
    data = example(tmp_path)
    data["onlineRL"]["endpoint"] = endpoint
    assert gateway_config_from_mapping(data).online_rl.endpoint == endpoint.rstrip("/")
    data["onlineRL"]["endpoint"] = "http://localhost:18081"
    assert "IP literal of loopback" in error_of(data)


@pytest.mark.parametrize(
    ("endpoint", "reason"),
    [
        ("http://127.0.0.1:18081 ", "must be an http URL on loopback without whitespace"),
        ("http://127.0.0.1:99999", "must be an http URL on loopback such as http://127.0.0.1:18081"),
        ("http://127.0.0.1:18081/v1", "must be a base URL without credentials, path, query or fragment"),
    ],
)
def test_a_bad_rl_endpoint_says_why(tmp_path: Path, endpoint: str, reason: str):
    data = example(tmp_path)
    data["onlineRL"]["endpoint"] = endpoint
    assert f"onlineRL.endpoint: {reason}" in error_of(data)


def test_errors_do_not_echo_values(tmp_path: Path):
    data = example(tmp_path)
    data["onlineRL"]["endpoint"] = "http://user:pw-SECRET@127.0.0.1:18081"
    data["global"]["listen"] = "host-SECRET"
    message = error_of(data)
    assert "onlineRL.endpoint:" in message and "global.listen:" in message and "SECRET" not in message


def test_required_sections_and_fields(tmp_path: Path):
    data = example(tmp_path)
    del data["onlineRL"]["configPath"]
    del data["lora"]
    message = error_of(data)
    assert "lora: required" in message and "onlineRL.configPath: required" in message


@pytest.mark.parametrize("port", [0, 65536, "80a", "", True, 8000.5, "123456"])
def test_instance_port(tmp_path: Path, port: Any):
    data = example(tmp_path)
    data["instances"][0]["port"] = port
    assert "instances.0.port:" in error_of(data)


def test_instance_names_unique(tmp_path: Path):
    data = example(tmp_path)
    data["instances"][1]["name"] = "vllm-0"
    assert "instances: instance names must be unique" in error_of(data)


def test_listen_forms(tmp_path: Path):
    for listen, host, port in [("[::1]:9000", "::1", 9000), ("0.0.0.0:0", "0.0.0.0", 0), ("gw.local:80", "gw.local", 80)]:
        data = example(tmp_path)
        data["global"]["listen"] = listen
        section = gateway_config_from_mapping(data).global_
        assert (section.listen_host, section.listen_port) == (host, port)


def test_load_gateway_config_file(tmp_path: Path):
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(example(tmp_path)))
    assert load_gateway_config(path) == gateway_config_from_mapping(example(tmp_path))

    path.write_text('{"global": {}, "global": {}}')
    with pytest.raises(GatewayConfigError, match="duplicate key 'global'"):
        load_gateway_config(path)
    path.write_text("[]")
    with pytest.raises(GatewayConfigError, match="must be a JSON object"):
        load_gateway_config(path)
    path.write_text('{"global": ')
    with pytest.raises(GatewayConfigError, match="invalid JSON at line 1"):
        load_gateway_config(path)
    with pytest.raises(GatewayConfigError, match="does not exist"):
        load_gateway_config(tmp_path / "missing.json")


# --- HMAC keys ------------------------------------------------------------------------------------------------


def config_with(tmp_path: Path, **global_section: str) -> GatewayConfig:
    return gateway_config_from_mapping(example(tmp_path, **{"global": global_section}))


def test_decode_key():
    assert decode_key(INS_KEY_HEX) == bytes([0x9F]) * 32
    assert decode_key("AB" * 32) == bytes([0xAB]) * 32  # hex digits in either case
    assert decode_key(API_KEY) == API_KEY.encode()
    assert decode_key("k" * 32) == b"k" * 32
    assert decode_key("é" * 16) == "é".encode() * 16  # 32 UTF-8 bytes
    for short in ("k" * 31, "ab" * 15, ""):
        with pytest.raises(ValueError):
            decode_key(short)


async def test_keys_from_file(tmp_path: Path):
    key_file = tmp_path / "keys.json"
    write_keys(key_file, {"apiHmacKey": API_KEY, "insHmacKey": INS_KEY_HEX, "other": 1})
    keys = await load_hmac_keys(config_with(tmp_path, hmacKeyFile=str(key_file)))
    assert keys == HmacKeys(api=API_KEY.encode(), ins=bytes([0x9F]) * 32)
    assert API_KEY not in repr(keys) and "9f9f" not in repr(keys) and "32 bytes" in repr(keys)

    write_keys(key_file, {"apiHmacKey": API_KEY})
    assert (await load_hmac_keys(config_with(tmp_path, hmacKeyFile=str(key_file)))).ins is None
    write_keys(key_file, {"apiHmacKey": API_KEY, "insHmacKey": ""})
    assert (await load_hmac_keys(config_with(tmp_path, hmacKeyFile=str(key_file)))).ins is None


async def serve_keys(path: Path, payload: bytes, *, close: bool = True) -> asyncio.AbstractServer:
    """A UNIX stream socket that writes `payload` to every connection (and keeps it open when `close` is False)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(payload)
        await writer.drain()
        if close:
            writer.close()
        else:
            await reader.read()  # until the client hangs up
            writer.close()

    return await asyncio.start_unix_server(handle, path=str(path))


@pytest.mark.parametrize("close", [True, False])
async def test_keys_from_socket(tmp_path: Path, close: bool):
    sock = tmp_path / "crypto.sock"
    payload = json.dumps({"apiHmacKey": INS_KEY_HEX, "insHmacKey": API_KEY}).encode() + b"\n"
    server = await serve_keys(sock, payload, close=close)
    async with server:
        keys = await load_hmac_keys(config_with(tmp_path, cryptoSock=str(sock)), timeout_s=5)
    assert keys == HmacKeys(api=bytes([0x9F]) * 32, ins=API_KEY.encode())


async def test_socket_that_never_completes_times_out(tmp_path: Path):
    sock = tmp_path / "crypto.sock"
    server = await serve_keys(sock, b'{"apiHmacKey": "' + API_KEY.encode(), close=False)
    async with server:
        with pytest.raises(GatewayConfigError, match="no complete key document within 0.3 s") as info:
            await load_hmac_keys(config_with(tmp_path, cryptoSock=str(sock)), timeout_s=0.3)
    assert API_KEY not in str(info.value)


async def test_missing_socket(tmp_path: Path):
    with pytest.raises(GatewayConfigError, match="cannot connect"):
        await load_hmac_keys(config_with(tmp_path, cryptoSock=str(tmp_path / "absent.sock")), timeout_s=1)


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"apiHmacKey": "short-" + "s" * 20}, "apiHmacKey: must be 64 hex digits or a string of 32..1024 bytes"),
        ({"insHmacKey": API_KEY}, "apiHmacKey: required"),
        ({"apiHmacKey": API_KEY, "insHmacKey": "tiny-SECRET"}, "insHmacKey: must be 64 hex digits"),
        ({"apiHmacKey": API_KEY, "insHmacKey": 7}, "insHmacKey: must be a string"),
        ([API_KEY], "must be a JSON object"),
    ],
)
async def test_key_errors_never_contain_key_material(tmp_path: Path, document: Any, expected: str):
    key_file = tmp_path / "keys.json"
    write_keys(key_file, document)
    with pytest.raises(GatewayConfigError) as info:
        await load_hmac_keys(config_with(tmp_path, hmacKeyFile=str(key_file)))
    message = str(info.value)
    assert expected in message and str(key_file) in message
    for secret in (API_KEY, "short-", "tiny-SECRET", "SECRET"):
        assert secret not in message


async def test_malformed_key_json_is_not_quoted(tmp_path: Path):
    key_file = tmp_path / "keys.json"
    write_keys(key_file, '{"apiHmacKey": "' + API_KEY + '", oops}')
    with pytest.raises(GatewayConfigError) as info:
        await load_hmac_keys(config_with(tmp_path, hmacKeyFile=str(key_file)))
    assert "invalid JSON at line 1" in str(info.value) and "SECRET" not in str(info.value)

    sock = tmp_path / "crypto.sock"
    server = await serve_keys(sock, b'{"apiHmacKey": "' + API_KEY.encode() + b'" ]')
    async with server:
        with pytest.raises(GatewayConfigError) as info:
            await load_hmac_keys(config_with(tmp_path, cryptoSock=str(sock)), timeout_s=5)
    assert "invalid JSON" in str(info.value) and "SECRET" not in str(info.value)


async def test_agent_keys_from_file_and_socket(tmp_path: Path):
    document = {"apiHmacKey": API_KEY, "insHmacKey": INS_KEY_HEX, "agentHmacKeys": [
        {"id": "support-bot", "key": AGENT_KEY_HEX}, {"id": "sales.bot_2", "key": OTHER_AGENT_KEY}]}
    key_file = write_keys(tmp_path / "keys.json", document)
    keys = await load_hmac_keys(config_with(tmp_path, hmacKeyFile=str(key_file)))
    assert keys.agents == {"support-bot": bytes([0xA7]) * 32, "sales.bot_2": OTHER_AGENT_KEY.encode()}
    assert "support-bot" in repr(keys) and "a7a7" not in repr(keys) and "SECRET" not in repr(keys)
    sock = tmp_path / "crypto.sock"
    async with await serve_keys(sock, json.dumps(document).encode()):
        assert (await load_hmac_keys(config_with(tmp_path, cryptoSock=str(sock)), timeout_s=5)) == keys
    for absent in ({"apiHmacKey": API_KEY}, {"apiHmacKey": API_KEY, "agentHmacKeys": None},
                   {"apiHmacKey": API_KEY, "agentHmacKeys": []}):
        write_keys(key_file, absent)
        assert (await load_hmac_keys(config_with(tmp_path, hmacKeyFile=str(key_file)))).agents == {}


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ({"id": "a", "key": AGENT_KEY_HEX}, "agentHmacKeys: must be a list"),
        (["support-bot"], "agentHmacKeys[0]: must be an object with exactly the members id and key"),
        ([{"id": "a"}], "agentHmacKeys[0]: must be an object with exactly the members id and key"),
        # A member this gateway does not know (a later per-key restriction) is never silently ignored; a lineage
        # limit that is not a list of lineage names is refused, never read as "every lineage".
        ([{"id": "a", "key": AGENT_KEY_HEX, "lineages": "support"}], "agentHmacKeys[0].lineages: must be a list"),
        ([{"id": "a", "key": AGENT_KEY_HEX, "lineages": ["Support"]}], "agentHmacKeys[0].lineages: must be a list"),
        ([{"id": "a", "key": AGENT_KEY_HEX, "lineages": ["v2"]}], "agentHmacKeys[0].lineages: must be a list"),
        # A registration cap that is no count is refused, never read as "no cap".
        ([{"id": "a", "key": AGENT_KEY_HEX, "maxLineages": -1}], "agentHmacKeys[0].maxLineages: must be an integer"),
        ([{"id": "a", "key": AGENT_KEY_HEX, "maxLineages": "5"}], "agentHmacKeys[0].maxLineages: must be an integer"),
        ([{"id": "a", "key": AGENT_KEY_HEX, "maxLineages": True}], "agentHmacKeys[0].maxLineages: must be an integer"),
        ([{"id": "a", "key": AGENT_KEY_HEX, "maxLineages": None}], "agentHmacKeys[0].maxLineages: must be an integer"),
        ([{"id": "a", "key": AGENT_KEY_HEX, "role": "operator"}], "agentHmacKeys[0]: must be an object with exactly"),
        ([{"id": "bad id", "key": AGENT_KEY_HEX}], "agentHmacKeys[0].id: must match"),
        ([{"id": "", "key": AGENT_KEY_HEX}], "agentHmacKeys[0].id: must match"),
        ([{"id": 7, "key": AGENT_KEY_HEX}], "agentHmacKeys[0].id: must match"),
        ([{"id": "a", "key": AGENT_KEY_HEX}, {"id": "a", "key": OTHER_AGENT_KEY}],
         "agentHmacKeys[1].id: duplicate id 'a'"),
        ([{"id": "a", "key": "tiny-SECRET"}], "agentHmacKeys[0].key: must be 64 hex digits"),
        ([{"id": "a", "key": ""}], "agentHmacKeys[0].key: required"),
    ],
)
async def test_agent_key_errors_name_the_entry_never_the_key(tmp_path: Path, entries: Any, expected: str):
    key_file = write_keys(tmp_path / "keys.json", {"apiHmacKey": API_KEY, "agentHmacKeys": entries})
    with pytest.raises(GatewayConfigError) as info:
        await load_hmac_keys(config_with(tmp_path, hmacKeyFile=str(key_file)))
    assert expected in str(info.value)
    for secret in ("SECRET", AGENT_KEY_HEX, API_KEY):
        assert secret not in str(info.value)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o602, 0o644, 0o666, 0o660])
async def test_a_key_file_group_or_others_may_read_or_write_is_refused(tmp_path: Path, mode: int):
    """Issue 28 item 10: the keys of every holder sit in this file; nobody but its owner may read or change it."""
    key_file = write_keys(tmp_path / "keys.json", {"apiHmacKey": API_KEY}, mode=mode)
    with pytest.raises(GatewayConfigError) as info:
        await load_hmac_keys(config_with(tmp_path, hmacKeyFile=str(key_file)))
    message = str(info.value)
    assert f"mode {mode:04o}" in message and "chmod 600" in message and str(key_file) in message
    assert "SECRET" not in message


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o700])
async def test_a_key_file_private_to_its_owner_is_accepted(tmp_path: Path, mode: int):
    key_file = write_keys(tmp_path / "keys.json", {"apiHmacKey": API_KEY}, mode=mode)
    assert (await load_hmac_keys(config_with(tmp_path, hmacKeyFile=str(key_file)))).api == API_KEY.encode()
    link = tmp_path / "link.json"  # a symlink to a private file (as secret mounts use) is judged by its target
    link.symlink_to(key_file)
    assert (await load_hmac_keys(config_with(tmp_path, hmacKeyFile=str(link)))).api == API_KEY.encode()


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ({"apiHmacKey": API_KEY, "insHmacKey": API_KEY}, "insHmacKey is the same key as apiHmacKey"),
        # The same bytes written two ways are the same key.
        ({"apiHmacKey": "AB" * 32, "insHmacKey": "ab" * 32}, "insHmacKey is the same key as apiHmacKey"),
        ({"apiHmacKey": API_KEY, "agentHmacKeys": [{"id": "a", "key": API_KEY}]},
         "agentHmacKeys[0] (id 'a') is the same key as apiHmacKey"),
        ({"apiHmacKey": API_KEY, "insHmacKey": INS_KEY_HEX, "agentHmacKeys": [{"id": "a", "key": INS_KEY_HEX}]},
         "agentHmacKeys[0] (id 'a') is the same key as insHmacKey"),
        ({"apiHmacKey": API_KEY, "agentHmacKeys": [{"id": "a", "key": AGENT_KEY_HEX},
                                                   {"id": "b", "key": AGENT_KEY_HEX}]},
         "agentHmacKeys[1] (id 'b') is the same key as agentHmacKeys[0] (id 'a')"),
    ],
)
async def test_identical_keys_of_different_holders_are_refused(tmp_path: Path, document: Any, expected: str):
    """Issue 28 item 10: a key shared by two roles (or two agents) lets either act as the other."""
    key_file = write_keys(tmp_path / "keys.json", document)
    with pytest.raises(GatewayConfigError) as info:
        await load_hmac_keys(config_with(tmp_path, hmacKeyFile=str(key_file)))
    assert expected in str(info.value) and "needs its own key" in str(info.value)
    for secret in ("SECRET", AGENT_KEY_HEX, INS_KEY_HEX, "AB" * 32, "ab" * 32):
        assert secret not in str(info.value)
    sock = tmp_path / "crypto.sock"  # the same rule for the AIGW key source
    async with await serve_keys(sock, json.dumps(document).encode()):
        with pytest.raises(GatewayConfigError, match="is the same key as"):
            await load_hmac_keys(config_with(tmp_path, cryptoSock=str(sock)), timeout_s=5)


def test_config_copy_is_independent(tmp_path: Path):
    data = example(tmp_path)
    before = copy.deepcopy(data)
    gateway_config_from_mapping(data)
    assert data == before


def test_max_body_bytes_default_and_bounds(tmp_path: Path):
    data = example(tmp_path)
    assert gateway_config_from_mapping(data).global_.max_body_bytes == 33_554_432
    data["global"]["maxBodyBytes"] = 4096
    assert gateway_config_from_mapping(data).global_.max_body_bytes == 4096
    for bad in (1023, 0, -1, "4096", 1.5, True):
        data["global"]["maxBodyBytes"] = bad
        assert "maxBodyBytes" in error_of(data), bad


def test_max_upstream_body_bytes_default_and_bounds(tmp_path: Path):
    """Generous but bounded by default (issue 28 item 4): no value turns the bound off."""
    data = example(tmp_path)
    assert gateway_config_from_mapping(data).global_.max_upstream_body_bytes == 64 << 20
    data["global"]["maxUpstreamBodyBytes"] = 4096
    assert gateway_config_from_mapping(data).global_.max_upstream_body_bytes == 4096
    for bad in (1023, 0, -1, None, "4096", 1.5, True):
        data["global"]["maxUpstreamBodyBytes"] = bad
        assert "maxUpstreamBodyBytes" in error_of(data), bad


def test_signature_settings_default_and_bounds(tmp_path: Path):
    data = example(tmp_path)
    section = gateway_config_from_mapping(data).global_
    # The AIGW form is off unless asked for; the replay cache is per key, the verifier's own default.
    assert (section.accept_legacy_signatures, section.replay_cache_size) == (False, 100_000)
    data["global"].update(acceptLegacySignatures=True, replayCacheSize=50)
    section = gateway_config_from_mapping(data).global_
    assert (section.accept_legacy_signatures, section.replay_cache_size) == (True, 50)
    assert gateway_config_from_mapping(gateway_config_from_mapping(data).to_json()).global_ == section  # round trip
    for bad in ("true", 1, None):
        data["global"]["acceptLegacySignatures"] = bad
        assert "acceptLegacySignatures" in error_of(data), bad
    data["global"]["acceptLegacySignatures"] = False
    for bad in (0, -1, "50", 1.5, True):
        data["global"]["replayCacheSize"] = bad
        assert "replayCacheSize" in error_of(data), bad


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "[::1]", "vllm-0", "vllm_a", "vllm-0.svc.cluster.local"])
def test_instance_hosts_accepted(tmp_path: Path, host: str):
    data = example(tmp_path)
    data["instances"][0]["instanceIp"] = host
    assert gateway_config_from_mapping(data).instances[0].instance_ip == host


@pytest.mark.parametrize("host", ["", "a b", "x/y", "user@host", "1.2.3.4:80", "\u00e9", "-a", "a" * 64])
def test_instance_hosts_no_url_can_carry_are_refused(tmp_path: Path, host: str):
    data = example(tmp_path)
    data["instances"][0]["instanceIp"] = host
    assert "instanceIp" in error_of(data)


def test_instance_health_and_registration_defaults_and_bounds(tmp_path: Path):
    config = gateway_config_from_mapping(example(tmp_path))
    health = config.instance_health
    assert (health.interval_s, health.timeout_s, health.failure_threshold) == (10.0, 5.0, 3)
    assert config.registration.max_instances == 64
    data = example(tmp_path, instanceHealth={"interval": "200ms", "timeout": "1s", "failureThreshold": 1},
                   registration={"maxInstances": 0})
    config = gateway_config_from_mapping(data)
    assert (config.instance_health.interval_s, config.registration.max_instances) == (0.2, 0)
    for section, key, bad in (("instanceHealth", "interval", "0s"), ("instanceHealth", "timeout", 5),
                              ("instanceHealth", "failureThreshold", 0), ("instanceHealth", "failureThreshold", "3"),
                              ("registration", "maxInstances", -1), ("registration", "maxInstances", 10_001),
                              ("registration", "maxInstances", True), ("registration", "cap", 3)):
        data = example(tmp_path, **{section: {key: bad}})
        assert error_of(data).startswith(f"gateway config: {section}.{key}: "), (section, key, bad)


def test_an_agent_keys_lineage_limit_is_read_and_absent_means_every_lineage() -> None:
    keys = gateway_keys_from_document({"apiHmacKey": API_KEY, "agentHmacKeys": [
        {"id": "a", "key": AGENT_KEY_HEX, "lineages": ["support", "default"]},
        {"id": "b", "key": OTHER_AGENT_KEY},
        {"id": "c", "key": "c" * 64, "lineages": []},
    ]}, source="test")
    assert keys.agent_lineages == {"a": frozenset({"support", "default"}), "c": frozenset()}
    assert set(keys.agents) == {"a", "b", "c"}
    assert keys.agent_lineage_caps == {}


def test_an_agent_keys_registration_cap_is_read_and_absent_means_none_of_its_own() -> None:
    keys = gateway_keys_from_document({"apiHmacKey": API_KEY, "agentHmacKeys": [
        {"id": "a", "key": AGENT_KEY_HEX, "maxLineages": 3, "lineages": ["x", "y"]},
        {"id": "b", "key": OTHER_AGENT_KEY},
        {"id": "c", "key": "c" * 64, "maxLineages": 0},
    ]}, source="test")
    assert keys.agent_lineage_caps == {"a": 3, "c": 0}
    assert keys.agent_lineages == {"a": frozenset({"x", "y"})}
