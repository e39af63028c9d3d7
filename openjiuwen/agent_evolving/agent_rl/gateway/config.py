"""Gateway configuration (CONTRACT §3.1): the AIGW JSON shape as frozen pydantic models, and where the HMAC keys
come from (the key document itself is parsed by common/signing_keys.py).

The config is parsed once, at the edge. Durations are Go strings (`300ms`, `1m30s`) stored as float seconds in
fields named with `_s`. Every model refuses unknown keys. Error messages name the field, never a value, and the HMAC
keys (which never sit in the config itself: they come from `global.hmacKeyFile` or `global.cryptoSock`) never
appear in any message, repr or log line. The key file must be private to its owner (no read or write permission for
group or others), and no two keys of the document may be equal (common/signing_keys.py checks both).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_network
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    PlainSerializer,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

from ..common import loopback
from ..common.bounded_files import MAX_CONFIG_BYTES, FileReadError, parse_json, read_json
from ..common.signing_keys import (
    MAX_KEY_DOCUMENT_BYTES,
    HmacKeys,
    KeyFileError,
    gateway_keys_from_document,
    read_gateway_keys,
)
from ..common.validation import (
    AbsolutePath,
    BodyLimitBytes,
    ConfigModel,
    ConnectionCap,
    LineageLabelTopK,
    ModelId,
    NamedLineage,
    NonBlank,
    NonNegativeInt,
    PositiveInt,
    config_invalid,
    split_url,
    validate_config,
)
from .auth.hmac_auth import REPLAY_CAPACITY
from .instances.instances import valid_host

KEY_SOCKET_TIMEOUT_S = 5.0

_DURATION_UNITS_S = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,  # U+00B5 MICRO SIGN, as Go accepts
    "μs": 1e-6,  # U+03BC GREEK SMALL LETTER MU, as Go accepts
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
# One component: a number with at least one digit (`1`, `1.5`, `.5`, `1.`) and a unit. Longest units first.
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)")


class GatewayConfigError(ValueError):
    """The gateway config or its key source cannot be read, parsed or validated. Names the field, never a value."""



# --- durations --------------------------------------------------------------------------------------------------


def parse_duration(text: str) -> float:
    """Seconds in a Go duration string: `300ms`, `30s`, `2m`, `1h`, `1m30s`, `1.5s`, `500us`, `-1s`.

    Units `ns`, `us` (`µs`, `μs`), `ms`, `s`, `m`, `h`, one or more components, an optional leading sign. A bare
    number (even `0`, which Go allows) is refused: the unit must always be written.

    :raises ValueError: when `text` is not a Go duration (the message does not quote it).
    """
    if not isinstance(text, str):
        raise ValueError("a duration must be a string such as '30s'")
    body = text
    sign = 1.0
    if body[:1] in ("+", "-"):
        sign = -1.0 if body[0] == "-" else 1.0
        body = body[1:]
    if not body:
        raise ValueError("a duration must be a number with a unit such as '30s' or '1m30s'")
    total = 0.0
    pos = 0
    while pos < len(body):
        match = _DURATION_PART.match(body, pos)
        if match is None:
            raise ValueError("a duration must be a number with a unit (ns, us, ms, s, m, h) such as '30s' or '1m30s'")
        total += float(match.group(1)) * _DURATION_UNITS_S[match.group(2)]
        pos = match.end()
    return sign * total


def format_duration(seconds: float) -> str:
    """A Go duration string for `seconds` that `parse_duration` reads back (used when dumping a config)."""
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    ms = seconds * 1000
    if abs(ms - round(ms)) < 1e-6:
        return f"{round(ms)}ms"
    return f"{round(seconds * 1e6)}us"


def _duration_input(value: Any) -> float:
    if not isinstance(value, str):
        raise config_invalid("must be a Go duration string such as '30s'")
    try:
        return parse_duration(value)
    except ValueError as exc:
        raise config_invalid(str(exc)) from None


def _positive(value: float) -> float:
    if not value > 0:
        raise config_invalid("must be a positive duration")
    return value


# Validated from a Go string, kept as float seconds, written back as a Go string by model_dump(mode="json").
Duration = Annotated[
    float,
    BeforeValidator(_duration_input),
    AfterValidator(_positive),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]


# --- field checks -----------------------------------------------------------------------------------------------


def _no_whitespace(value: str) -> str:
    if not value or any(c.isspace() for c in value):
        raise config_invalid("must be non-empty and contain no whitespace")
    return value


def _host(value: str) -> str:
    if not valid_host(value):
        raise config_invalid("must be a DNS name or an IP address")
    return value


def _port(value: Any) -> int:
    # AIGW writes instance ports as numbers or numeric strings; booleans and other types are refused.
    if isinstance(value, bool):
        raise config_invalid("must be a port number 1..65535")
    if isinstance(value, str):
        if not (value.isascii() and value.isdigit() and len(value) <= 5):
            raise config_invalid("must be a port number 1..65535")
        value = int(value)
    if not isinstance(value, int) or not 1 <= value <= 65535:
        raise config_invalid("must be a port number 1..65535")
    return value


def _split_listen(value: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port`; port 0 asks the OS for a free port (tests)."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit() and len(port) <= 5) or int(port) > 65535:
        raise config_invalid("must be 'host:port' with a port 0..65535")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() for c in host) or ("]" in host or "[" in host):
        raise config_invalid("must be 'host:port' with a port 0..65535")
    if ":" in host:  # an IPv6 literal must be bracketed, and valid
        try:
            ip_address(host)
        except ValueError:
            raise config_invalid("must be 'host:port'; write IPv6 hosts as '[::1]:8080'") from None
        if not value.startswith("["):
            raise config_invalid("must be 'host:port'; write IPv6 hosts as '[::1]:8080'")
    return host, int(port)


def _check_listen(value: str) -> str:
    _split_listen(value)
    return value


def _check_network(value: str) -> str:
    try:
        ip_network(value)
    except ValueError:
        raise config_invalid("must be a network such as 127.0.0.0/8 or fd00::/8 (no host bits set)") from None
    return value


def _check_path(value: str) -> str:
    if not value.strip() or "\x00" in value:
        raise config_invalid("must be a non-empty path")
    return value


def _check_loopback_url(value: str) -> str:
    parts = split_url(value, whitespace="must be an http URL on loopback without whitespace",
                      malformed="must be an http URL on loopback such as http://127.0.0.1:18081")
    host = parts.hostname
    if parts.scheme != "http" or host is None or not loopback.is_loopback_ip(host):
        raise config_invalid(f"must be an http URL on {loopback.ALLOWED}, such as http://127.0.0.1:18081")
    if parts.username or parts.password or parts.query or parts.fragment or parts.path not in ("", "/"):
        raise config_invalid("must be a base URL without credentials, path, query or fragment")
    return value.rstrip("/")


Token = Annotated[StrictStr, AfterValidator(_no_whitespace)]
PathText = Annotated[StrictStr, AfterValidator(_check_path)]
# LoRA adapter slots of an instance (0: unlimited, or none reserved).
SlotCount = Annotated[StrictInt, Field(ge=0, le=100_000)]


# --- the models -----------------------------------------------------------------------------------------------
# They take the AIGW camelCase names (aliases) only: a snake_case key is as unknown as any other.


class GlobalSection(ConfigModel):
    listen: Annotated[StrictStr, AfterValidator(_check_listen)] = "127.0.0.1:8080"
    hmac_key_file: PathText | None = Field(default=None, alias="hmacKeyFile")
    crypto_sock: PathText | None = Field(default=None, alias="cryptoSock")
    # Project gateway: a bound on every request body (inference routes are unsigned, so anyone who reaches the port
    # could otherwise make it buffer any amount). Larger bodies get 413 `payload_too_large`.
    max_body_bytes: BodyLimitBytes = Field(default=33_554_432, alias="maxBodyBytes")
    # Project gateway: a bound on what a vLLM instance's answer may make the gateway hold: a JSON answer, an error
    # answer, one SSE event, a captured stream in all (past it 502 `upstream_too_large`, or the stream ends). 64 MiB
    # is about five times the largest answer a capture asks for (131,072 tokens with their logprobs, ~100 bytes each).
    max_upstream_body_bytes: BodyLimitBytes = Field(default=67_108_864, alias="maxUpstreamBodyBytes")
    # Project gateway: accept the AIGW signature form (timestamp ‖ body; method, path and query unsigned) beside
    # version 3 (operator and instance keys only). Off by default: only then can no signed request be replayed on
    # another route or re-targeted to another session (auth/hmac_auth.py).
    accept_legacy_signatures: StrictBool = Field(default=False, alias="acceptLegacySignatures")
    # Project gateway: live (timestamp, signature) pairs remembered per key (api, instance, each agent key apart); a key
    # whose cache is full of live pairs has its further requests refused until some expire.
    replay_cache_size: PositiveInt = Field(default=REPLAY_CAPACITY, alias="replayCacheSize")
    # Project gateway, slow clients (common/slow_clients.py): a request head must be complete within headerTimeout
    # (else 408), an idle kept-alive connection closes after keepAliveTimeout, and past maxConnections the oldest
    # connection without a complete head is closed to make room.
    header_timeout_s: Duration = Field(default=10.0, alias="headerTimeout")
    keep_alive_timeout_s: Duration = Field(default=5.0, alias="keepAliveTimeout")
    max_connections: ConnectionCap = Field(default=4096, alias="maxConnections")

    @model_validator(mode="after")
    def _exactly_one_key_source(self) -> "GlobalSection":
        if (self.hmac_key_file is None) == (self.crypto_sock is None):
            raise config_invalid("set exactly one of hmacKeyFile and cryptoSock")
        return self

    @property
    def listen_host(self) -> str:
        return _split_listen(self.listen)[0]

    @property
    def listen_port(self) -> int:
        return _split_listen(self.listen)[1]


class InstanceConfig(ConfigModel):
    name: Token
    model: Token
    instance_ip: Annotated[StrictStr, AfterValidator(_host)] = Field(alias="instanceIp")
    port: Annotated[int, BeforeValidator(_port)]
    # Project gateway (adapter paging, docs/lineages.md): LoRA adapters this instance may hold at once (its vLLM
    # `--max-cpu-loras`); absent: `lora.maxLorasPerInstance`; 0: unlimited.
    max_loras: SlotCount | None = Field(default=None, alias="maxLoras")

    @property
    def base_url(self) -> str:
        ip = self.instance_ip
        host = f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip  # bare IPv6 literals get brackets
        return f"http://{host}:{self.port}"


class LoraSection(ConfigModel):
    root: AbsolutePath
    state_path: PathText = Field(alias="statePath")
    operation_timeout_s: Duration = Field(default=60.0, alias="operationTimeout")
    # Project gateway (adapter paging, docs/lineages.md): adapters an instance holds at once unless its own `maxLoras`
    # says otherwise (0: unlimited, every active version on every instance as before), and how long a request waits
    # for a slot to free before 503 `lora_capacity_exhausted`.
    max_loras_per_instance: SlotCount = Field(default=0, alias="maxLorasPerInstance")
    page_timeout_s: Duration = Field(default=30.0, alias="pageTimeout")
    # Project gateway (issue 37 item 2): slots of each paging instance that requests outside a Task never keep in
    # use, so that traffic outside Tasks cannot starve Tasks of slots (docs/lineages.md "Tasks first").
    task_reserved_slots: SlotCount = Field(default=1, alias="taskReservedSlots")
    # Project gateway (issue 37): versions of a line that running Tasks may keep loaded besides the line's active
    # version and canary candidate; the Tasks pinned to older ones are stopped (docs/lineages.md "Leases").
    max_leased_versions: Annotated[StrictInt, Field(ge=0, le=10_000)] = Field(
        default=4, alias="maxLeasedVersionsPerLine")
    # Project gateway (issue 37 item 1): lineages whose active version anyone may name outside a Task, as the
    # default line's; any other lineage's versions take a signed request (docs/lineages.md "Private lines").
    open_lineages: list[NamedLineage] = Field(
        default_factory=list, alias="openLineages")


class InstanceHealthSection(ConfigModel):
    """Project gateway (issue 19): periodic `GET /health` of every vLLM instance (instances/health.py)."""

    interval_s: Duration = Field(default=10.0, alias="interval")
    timeout_s: Duration = Field(default=5.0, alias="timeout")
    failure_threshold: Annotated[StrictInt, Field(ge=1, le=100)] = Field(default=3, alias="failureThreshold")


class RegistrationSection(ConfigModel):
    """Project gateway: what `register-instance` may add (issue 19: how many; issue 28 item 1: which addresses,
    instances/instance_addresses.py; item 2: whether registered instances serve captured traffic)."""

    max_instances: Annotated[StrictInt, Field(ge=0, le=10_000)] = Field(default=64, alias="maxInstances")
    # Networks whose loopback, link-local, … addresses a registration may still name (e.g. "127.0.0.0/8" when vLLM
    # runs on the gateway's host). Empty: none.
    allowed_networks: list[Annotated[StrictStr, AfterValidator(_check_network)]] = Field(
        default_factory=list, alias="allowedNetworks")
    # Off: registered instances serve traffic outside Tasks only (bypass), so no holder of the instance key can put
    # completions into training data. On (default): today's behaviour, as an AIGW routes, all instances alike.
    capture_traffic: StrictBool = Field(default=True, alias="captureTraffic")

    @property
    def networks(self) -> list[IPv4Network | IPv6Network]:
        return [ip_network(n) for n in self.allowed_networks]


class MetricsSection(ConfigModel):
    """Project gateway: the bounded `lineage` label of per-request metrics (common/lineage_labels.py,
    docs/lineages.md)."""

    # Lineages with their own label beside `default`; every other lineage is `other` (0: all of them).
    lineage_label_top_k: LineageLabelTopK = Field(default=20, alias="lineageLabelTopK")
    # How long a labelled lineage may go without captured traffic before another lineage may take its slot.
    lineage_label_idle_s: Duration = Field(default=3600.0, alias="lineageLabelIdle")


class OnlineRLSection(ConfigModel):
    command: list[NonBlank] = Field(min_length=1)
    # The model id the RL Service child serves (= its config's `model_id`): the gateway reads it here, never from the
    # child's config, and checks the child's /health answer against it.
    model_id: ModelId = Field(alias="modelId")
    config_path: PathText = Field(alias="configPath")
    endpoint: Annotated[StrictStr, AfterValidator(_check_loopback_url)] = "http://127.0.0.1:18081"
    hook_timeout_s: Duration = Field(default=30.0, alias="hookTimeout")
    hook_retries: NonNegativeInt = Field(default=2, alias="hookRetries")
    drain_timeout_s: Duration = Field(default=120.0, alias="drainTimeout")
    control_timeout_s: Duration = Field(default=300.0, alias="controlTimeout")


class GatewayConfig(ConfigModel):
    global_: GlobalSection = Field(alias="global")
    instances: list[InstanceConfig] = Field(default_factory=list)
    lora: LoraSection
    online_rl: OnlineRLSection = Field(alias="onlineRL")
    instance_health: InstanceHealthSection = Field(default_factory=InstanceHealthSection, alias="instanceHealth")
    registration: RegistrationSection = Field(default_factory=RegistrationSection)
    metrics: MetricsSection = Field(default_factory=MetricsSection)

    @field_validator("instances")
    @classmethod
    def _unique_names(cls, value: list[InstanceConfig]) -> list[InstanceConfig]:
        names = [i.name for i in value]
        if len(names) != len(set(names)):
            raise config_invalid("instance names must be unique")
        return value

    def to_json(self) -> dict[str, Any]:
        """The AIGW JSON shape again (camelCase, Go durations); `gateway_config_from_mapping` reads it back."""
        return self.model_dump(mode="json", by_alias=True)


# --- loader -----------------------------------------------------------------------------------------------------


def gateway_config_from_mapping(data: Any, *, source: str = "gateway config") -> GatewayConfig:
    """Validate an already parsed JSON object; raise GatewayConfigError naming each offending field."""
    return validate_config(GatewayConfig, data, source=source, error=GatewayConfigError, shape="a JSON object")


def load_gateway_config(path: str | os.PathLike[str]) -> GatewayConfig:
    """Read and validate the gateway's JSON config file.

    :param path: the file (`~` expanded); at most 1 MiB of UTF-8 JSON, duplicate keys refused.
    :raises GatewayConfigError: on any I/O, parse or validation error, naming the offending field.
    """
    resolved = Path(os.path.expanduser(os.fspath(path)))
    try:
        data = read_json(resolved, f"gateway config {resolved}", MAX_CONFIG_BYTES)
    except FileReadError as exc:
        raise GatewayConfigError(str(exc)) from None
    return gateway_config_from_mapping(data, source=f"gateway config {resolved}")


# --- HMAC keys --------------------------------------------------------------------------------------------------


async def _read_key_socket(path: str, timeout_s: float) -> bytes:
    """Connect, read until a complete JSON object or EOF, within `timeout_s` and MAX_KEY_DOCUMENT_BYTES."""
    where = f"cryptoSock {path}"
    buffer = b""
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_unix_connection(path)
            try:
                while len(buffer) <= MAX_KEY_DOCUMENT_BYTES:
                    chunk = await reader.read(4096)
                    if not chunk:
                        return buffer
                    buffer += chunk
                    # The socket may keep the connection open after writing: stop at the first complete object.
                    if buffer.rstrip().endswith(b"}"):
                        try:
                            json.loads(buffer)
                            return buffer
                        except ValueError:
                            continue
            finally:
                writer.close()
                try:
                    await writer.wait_closed()
                except OSError:
                    pass  # the peer may already have gone; nothing left to read from it
    except TimeoutError:
        raise GatewayConfigError(f"{where}: no complete key document within {timeout_s} s") from None
    except OSError as exc:
        raise GatewayConfigError(f"{where}: cannot connect ({exc.strerror or type(exc).__name__})") from None
    raise GatewayConfigError(f"{where}: key document larger than {MAX_KEY_DOCUMENT_BYTES} bytes")


async def load_hmac_keys(config: GatewayConfig, *, timeout_s: float = KEY_SOCKET_TIMEOUT_S) -> HmacKeys:
    """Load the HMAC keys from `global.hmacKeyFile` (read off the event loop) or `global.cryptoSock`.

    :param timeout_s: bound of the whole socket exchange (connect and read).
    :raises GatewayConfigError: naming the source and the member, never quoting key material.
    """
    section = config.global_
    try:
        if section.hmac_key_file is not None:
            path = Path(os.path.expanduser(section.hmac_key_file))
            return await asyncio.to_thread(read_gateway_keys, path, where=f"hmacKeyFile {path}")
        assert section.crypto_sock is not None  # the model guarantees exactly one source
        where = f"cryptoSock {section.crypto_sock}"
        raw = await _read_key_socket(section.crypto_sock, timeout_s)
        return gateway_keys_from_document(parse_json(raw, where), source=where)
    except (FileReadError, KeyFileError) as exc:
        raise GatewayConfigError(str(exc)) from None
