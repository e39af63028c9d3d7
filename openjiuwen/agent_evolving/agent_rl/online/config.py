"""RL Service configuration (CONTRACT §8): one frozen pydantic model and its YAML loader.

The config is parsed once, at the edge; no other module reads files or the environment for settings. Secrets
(`redis_url`, which may carry a password, and `judge_api_key`) are `SecretStr`, so reprs and logs show asterisks,
and no error message built here ever contains an input value.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    Field,
    SecretStr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from ..common import loopback
from ..common.bounded_files import MAX_CONFIG_BYTES, FileReadError, read_text
from ..common.validation import (
    AbsolutePath,
    BodyLimitBytes,
    ConfigModel,
    ConnectionCap,
    LineageLabelTopK,
    ModelId,
    NonBlank,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    config_invalid,
    split_url,
    validate_config,
)
from .rewards.config import RewardPolicyConfig
from .rollout.config import RolloutConfig
from .training.constrained import ConstrainedSamplesConfig
from .training.training_policy import TrainingPolicyConfig

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
FORBIDDEN_CONFIG_ROOTS = (Path("/proc"), Path("/sys"), Path("/dev"))


class ConfigError(ValueError):
    """The config file cannot be read, parsed or validated. The message names the field, never a secret value."""



# --- field checks (each gets a value already of the right type) -------------------------------------------------


def _check_listen_host(value: str) -> str:
    if not loopback.is_loopback_ip(value):
        raise config_invalid(f"the service binds loopback only: {loopback.ALLOWED}, such as 127.0.0.1")
    return value


def _check_http_url(value: str) -> str:
    parts = split_url(value, whitespace="must be an http(s) URL without whitespace",
                      malformed="must be a valid http(s) URL")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise config_invalid("must be an http:// or https:// URL with a host")
    if parts.query or parts.fragment:
        raise config_invalid("must be a base URL without query or fragment")
    return value.rstrip("/")


def _check_optional_http_url(value: str) -> str:
    if value == "":
        return value
    return _check_http_url(value)


def _check_redis_url(value: SecretStr) -> SecretStr:
    url = value.get_secret_value()
    if not url.lower().startswith(REDIS_SCHEMES):
        raise config_invalid("must start with redis://, rediss:// or unix://")
    if any(c.isspace() for c in url):
        raise config_invalid("must not contain whitespace")
    if url.lower().startswith("unix://") and len(url) == len("unix://"):
        raise config_invalid("unix:// needs a socket path")
    return value


def _check_gpu_ids(value: str) -> str:
    if value.strip() == "":
        return ""
    items = [item.strip() for item in value.split(",")]
    if not all(item.isascii() and item.isdigit() for item in items):
        raise config_invalid("must be empty or a comma-separated list of non-negative integers (e.g. '0,1')")
    ids = [str(int(item)) for item in items]
    if len(set(ids)) != len(ids):
        raise config_invalid("must not repeat a GPU index")
    return ",".join(ids)


def _check_ray_quantity(value: float | None) -> float | None:
    # Ray's own rule for a resource request: a fraction up to 1 (several actors share the unit), whole above it.
    if value is not None and value > 1 and not float(value).is_integer():
        raise config_invalid("must be a fraction up to 1 or a whole number (Ray's rule for resource requests)")
    return value


def _check_log_level(value: str) -> str:
    level = value.strip().upper()
    if level not in LOG_LEVELS:
        raise config_invalid("must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL")
    return level


HttpUrl = Annotated[StrictStr, AfterValidator(_check_http_url)]
Seconds = PositiveFloat


class LineagesConfig(ConfigModel):
    """Lineages (docs/lineages.md): named lines of LoRA versions on the model, registered on first use."""

    # Registered lineages besides `default`; a Task start that would register one more is refused (409).
    max_count: PositiveInt = 1000
    # Archive a lineage with no Task started for this long (docs/lineages.md "Lifecycle"); None: never.
    idle_archive_seconds: PositiveInt | None = None
    # How often the leader's lineage loop runs: the idle sweep, and unloads or deletions still to finish.
    lifecycle_interval_seconds: PositiveInt = 60
    # Lineages with their own `lineage` label on the RL Service's freshness histograms beside `default` (the rest
    # are `other`; common/lineage_labels.py), so thousands of lineages stay a bounded set of series.
    metrics_label_top_k: LineageLabelTopK = 20


class LocalTrainerConfig(ConfigModel):
    """The `local` trainer backend's processes (docs/training.md "Warm trainer")."""

    # false: a fresh trainer process per Training Run (loads the base model each time). true: one long-lived trainer
    # keeps the base model loaded and trains the runs in flight together, each with its own adapter.
    warm_trainer: StrictBool = False
    # Warm trainer only: runs trained together in one step at most, and how long it waits after a run arrives for
    # the others claimed with it.
    max_runs_per_step: Annotated[StrictInt, Field(ge=1, le=64)] = 8
    gather_seconds: Annotated[float, Field(ge=0, le=10, strict=True, allow_inf_nan=False)] = 0.2


class RLServiceConfig(ConfigModel):
    """Every setting of one RL Service process (CONTRACT §8). Unknown keys are rejected."""

    # Process and peers.
    listen_host: Annotated[StrictStr, AfterValidator(_check_listen_host)] = "127.0.0.1"
    listen_port: Annotated[StrictInt, Field(ge=1, le=65535)] = 18081
    redis_url: Annotated[SecretStr, AfterValidator(_check_redis_url)]
    model_id: ModelId
    base_model_path: NonBlank
    aigw_endpoint: HttpUrl = "http://127.0.0.1:8080"
    # Worker processes serving the port (online/workers/): "auto" = half the cores, 1 to 8 (the gateway, Redis and
    # vLLM share the host). 1 = one process, no supervisor and no lease.
    workers: Literal["auto"] | Annotated[StrictInt, Field(ge=1, le=64)] = "auto"

    # Judge (configured iff judge_endpoint is non-empty).
    judge_endpoint: Annotated[StrictStr, AfterValidator(_check_optional_http_url)] = ""
    judge_model: StrictStr = Field(default="", validate_default=True)
    judge_api_key: SecretStr = SecretStr("")
    judge_votes: PositiveInt = 1
    judge_min_votes: PositiveInt | None = None
    judge_retries: NonNegativeInt = 2
    judge_timeout: Seconds = 30.0
    turn_publish_timeout_seconds: Seconds = 30.0

    # Training and activation.
    lora_activation_timeout: Seconds = 150.0
    lora_activation_attempts: PositiveInt = 4
    min_samples_for_training: PositiveInt = 32
    max_samples_per_run: PositiveInt = Field(default=32, validate_default=True)
    max_policy_lag: NonNegativeInt | None = None
    trainer_backend: Literal["local", "verl", "scripted"] = "local"
    advantage_estimator: Literal["reinforce_plus_plus", "grpo"] = "reinforce_plus_plus"
    tis_cap: PositiveFloat | None = None
    ppo_samples_per_step: NonNegativeInt = 0
    ppo_config_path: StrictStr | None = None
    ray_address: StrictStr = ""
    nproc_per_node: PositiveInt = 1
    training_gpu_ids: Annotated[StrictStr, AfterValidator(_check_gpu_ids)] = ""
    # verl: what each rank of a run asks Ray for (its placement group's bundle; docs/training.md "Concurrent verl
    # runs"). GPUs: null = one when the cluster has GPUs (none on a CPU-only Ray); a fraction lets runs share a GPU.
    ray_gpus_per_rank: Annotated[PositiveFloat | None, AfterValidator(_check_ray_quantity)] = None
    ray_cpus_per_rank: Annotated[PositiveFloat, AfterValidator(_check_ray_quantity)] = 1.0
    # verl: how long a run may wait for its resources (shown as waiting meanwhile); null = until placed or stopped.
    ray_placement_timeout_seconds: Seconds | None = None
    training_tmp_root: NonBlank = "/tmp/agent_rl_online"
    local: LocalTrainerConfig = LocalTrainerConfig()  # trainer_backend local only
    lora_repository_path: AbsolutePath

    # Retention.
    trajectory_retention_seconds: PositiveInt = 604800
    task_retention_seconds: PositiveInt = 604800
    reward_timeout_seconds: PositiveInt = 86400
    run_retention_seconds: PositiveInt = 2592000
    retention_sweep_interval_seconds: PositiveInt = 60

    # Rewards from several, possibly late, sources (docs/rewards.md); null = one score at publication, as always.
    reward_policy: RewardPolicyConfig | None = None

    # How a new version reaches users (docs/rollout.md): immediate (default), canary or manual.
    rollout: RolloutConfig = RolloutConfig()

    # When the leader starts Training Runs by itself (docs/training.md); off by default: manual runs only.
    training_policy: TrainingPolicyConfig = TrainingPolicyConfig()

    # Lineages besides `default` (docs/lineages.md).
    lineages: LineagesConfig = LineagesConfig()

    # How samples whose sampling was constrained are trained, per kind: correct (off-policy) or exclude
    # (docs/training.md "Constrained samples").
    constrained_samples: ConstrainedSamplesConfig = ConstrainedSamplesConfig()

    # HTTP and logging.
    max_body_bytes: BodyLimitBytes = 33554432
    # Slow clients (common/slow_clients.py): head deadline (408 after it), idle keep-alive, and the connection cap past
    # which the oldest connection without a complete request head is closed.
    http_header_timeout_seconds: Seconds = 10.0
    http_keep_alive_seconds: Seconds = 5.0
    http_max_connections: ConnectionCap = 4096
    record_dir: StrictStr = "records"  # JSONL copy of stored rail samples (rail_ingest/jsonl_copy.py); "" = none
    record_max_bytes: PositiveInt = 67108864
    record_backup_count: PositiveInt = 5
    log_path: NonBlank = "rl-service.log"
    log_max_bytes: PositiveInt = 10485760
    log_backup_count: PositiveInt = 5
    log_level: Annotated[StrictStr, AfterValidator(_check_log_level)] = "INFO"
    log_format: Literal["text", "json"] = "text"  # json: one object per line with rl_task_id / capture_id / run id

    # Cross-field rules are field validators (not a model validator) so each error carries its field name.
    # They rely on declaration order: info.data holds only the fields declared, and validated, before.

    @field_validator("judge_model")
    @classmethod
    def _judge_model_required(cls, value: str, info: ValidationInfo) -> str:
        if info.data.get("judge_endpoint") and not value.strip():
            raise config_invalid("required when judge_endpoint is set")
        return value

    @field_validator("judge_min_votes")
    @classmethod
    def _min_votes_within_votes(cls, value: int | None, info: ValidationInfo) -> int | None:
        votes = info.data.get("judge_votes")
        if value is not None and votes is not None and value > votes:
            raise config_invalid("must be between 1 and judge_votes")
        return value

    @field_validator("max_samples_per_run")
    @classmethod
    def _max_at_least_min(cls, value: int, info: ValidationInfo) -> int:
        minimum = info.data.get("min_samples_for_training")
        if minimum is not None and value < minimum:
            raise config_invalid("must be >= min_samples_for_training")
        return value

    @field_validator("ray_gpus_per_rank")
    @classmethod
    def _gpus_either_pinned_or_requested(cls, value: float | None, info: ValidationInfo) -> float | None:
        # Pinned GPUs (training_gpu_ids) are exported to the ranks, which ask Ray for none: the two cannot combine.
        if value is not None and info.data.get("training_gpu_ids"):
            raise config_invalid("must be null when training_gpu_ids pins the GPUs (its ranks ask Ray for no GPU)")
        return value

    @field_validator("ppo_config_path")
    @classmethod
    def _ppo_config_exists(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.strip():
            raise config_invalid("must be null or the path of an existing file")
        path = Path(value).expanduser()
        try:
            is_file = path.is_file()
        except (OSError, ValueError):
            is_file = False
        if not is_file:
            raise config_invalid("must be the path of an existing file")
        return str(path.resolve())

    @property
    def judge_configured(self) -> bool:
        return self.judge_endpoint != ""

    @property
    def worker_count(self) -> int:
        """`workers` resolved: "auto" is half the cores, at least 1 and at most 8."""
        if self.workers == "auto":
            return max(1, min(8, (os.cpu_count() or 1) // 2))
        return self.workers


# --- loader ---------------------------------------------------------------------------------------------------------


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys instead of silently keeping the last one."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`; explicit keys may override merged ones
            continue
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # unhashable key; the default constructor reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _under_forbidden_root(path: Path) -> bool:
    return any(path == root or root in path.parents for root in FORBIDDEN_CONFIG_ROOTS)


def _check_config_path(path: Path, shown: str) -> None:
    if ".." in path.parts:
        raise ConfigError(f"config path {shown}: must not contain '..' components")
    if _under_forbidden_root(path):
        raise ConfigError(f"config path {shown}: must not lie under /proc, /sys or /dev")


def _resolve_config_path(path: str | os.PathLike[str]) -> Path:
    try:
        raw = os.fsdecode(os.fspath(path))
    except TypeError:
        raise ConfigError("config path must be a string or path-like object") from None
    if not raw.strip() or "\x00" in raw:
        raise ConfigError("config path must be a non-empty path")
    _check_config_path(Path(raw), raw)
    expanded = Path(os.path.expanduser(raw))
    _check_config_path(expanded, raw)
    _check_config_path(Path(os.path.abspath(expanded)), raw)
    try:
        resolved = expanded.resolve()  # follows symlinks: the target is checked too
    except (OSError, RuntimeError) as exc:
        raise ConfigError(f"config path {raw}: cannot resolve ({type(exc).__name__})") from None
    _check_config_path(resolved, raw)
    return resolved


def _read_config_text(path: Path) -> str:
    try:
        return read_text(path, f"config file {path}", MAX_CONFIG_BYTES)
    except FileReadError as exc:
        raise ConfigError(str(exc)) from None


def _parse_yaml(text: str, path: Path) -> Any:
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        # Only the problem and its position: str(exc) would quote the offending line, which may hold a secret.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ConfigError(f"config file {path}: invalid YAML{where}: {problem}") from None


def config_from_mapping(data: Any, *, source: str = "config") -> RLServiceConfig:
    """Validate an already parsed mapping; raise ConfigError naming each offending field (never its value: the Redis
    password may be one)."""
    return validate_config(RLServiceConfig, data, source=source, error=ConfigError, shape="a mapping of settings")


def load_config(path: str | os.PathLike[str]) -> RLServiceConfig:
    """Read, parse and validate the YAML (or JSON) config at `path`.

    :param path: the config file; `~` is expanded and symlinks resolved. It must not contain `..` components nor
        lie under /proc, /sys or /dev, before or after resolution.
    :raises ConfigError: on any I/O, parse or validation error, with a message naming the offending field.
    """
    resolved = _resolve_config_path(path)
    text = _read_config_text(resolved)
    data = _parse_yaml(text, resolved)
    return config_from_mapping(data, source=f"config file {resolved}")
