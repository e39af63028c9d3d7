"""RLServiceConfig and load_config (CONTRACT §8): defaults, every validation rule, loader rules, secrecy."""

from __future__ import annotations

import json
import traceback
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import SecretStr, ValidationError

from openjiuwen.agent_evolving.agent_rl.online.config import (
    ConfigError,
    LineagesConfig,
    RLServiceConfig,
    config_from_mapping,
    load_config,
)
from openjiuwen.agent_evolving.agent_rl.online.config import LocalTrainerConfig
from openjiuwen.agent_evolving.agent_rl.online.rollout.config import RolloutConfig
from openjiuwen.agent_evolving.agent_rl.common.constraints import GRAMMAR_KINDS, KINDS, POLICY_DEFAULTS, policy_key
from openjiuwen.agent_evolving.agent_rl.online.training.constrained import ConstrainedSamplesConfig
from openjiuwen.agent_evolving.agent_rl.online.training.training_policy import TrainingPolicyConfig
from openjiuwen.agent_evolving.agent_rl.online.assembly import make_judge

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "deploy" / "rl-service.example.yaml"
DOC = ROOT / "docs" / "configuration.md"

REDIS_PASSWORD = "s3cret-redis-pw"
JUDGE_KEY = "sk-judge-very-secret"

REQUIRED: dict[str, Any] = {
    "redis_url": "redis://127.0.0.1:6379/0",
    "model_id": "qwen-agent",
    "base_model_path": "/models/qwen",
    "lora_repository_path": "/var/lib/openjiuwen-rl/loras",
}


def make(**overrides: Any) -> RLServiceConfig:
    return config_from_mapping({**REQUIRED, **overrides})


def required_votes(config: RLServiceConfig) -> int:
    """Votes the service's Judge needs, through the real path (config → `make_judge` → `JudgeScorer`); a Judge
    endpoint is added when `config` names none, so the judge_votes/judge_min_votes under test decide alone."""
    if not config.judge_configured:
        config = config.model_copy(update={"judge_endpoint": "http://127.0.0.1:8000", "judge_model": "judge"})
    judge = make_judge(config)
    assert judge is not None
    return judge.min_votes


def error_of(**overrides: Any) -> str:
    with pytest.raises(ConfigError) as info:
        make(**overrides)
    return str(info.value)


def write(tmp_path: Path, text: str, name: str = "rl.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# --- defaults ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("cores", "count"), [(1, 1), (2, 1), (4, 2), (16, 8), (64, 8), (None, 1)])
def test_auto_workers_are_half_the_cores_from_one_to_eight(monkeypatch, cores, count) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    assert make().worker_count == count
    assert make(workers=3).worker_count == 3


@pytest.mark.parametrize("bad", [0, -1, 65, "many", True, 2.0, None])
def test_workers_must_be_auto_or_a_count(bad) -> None:
    with pytest.raises(ConfigError, match="workers"):
        make(workers=bad)


def test_defaults_match_the_contract() -> None:
    config = make()
    expected = {
        "listen_host": "127.0.0.1",
        "listen_port": 18081,
        "model_id": "qwen-agent",
        "base_model_path": "/models/qwen",
        "aigw_endpoint": "http://127.0.0.1:8080",
        "judge_endpoint": "",
        "judge_model": "",
        "judge_votes": 1,
        "judge_min_votes": None,
        "judge_retries": 2,
        "judge_timeout": 30.0,
        "turn_publish_timeout_seconds": 30.0,
        "lora_activation_timeout": 150.0,
        "lora_activation_attempts": 4,
        "min_samples_for_training": 32,
        "max_samples_per_run": 32,
        "max_policy_lag": None,
        "trainer_backend": "local",
        "advantage_estimator": "reinforce_plus_plus",
        "tis_cap": None,
        "ppo_samples_per_step": 0,
        "ppo_config_path": None,
        "ray_address": "",
        "nproc_per_node": 1,
        "training_gpu_ids": "",
        "ray_gpus_per_rank": None,
        "ray_cpus_per_rank": 1.0,
        "ray_placement_timeout_seconds": None,
        "training_tmp_root": "/tmp/agent_rl_online",
        "local": LocalTrainerConfig(),
        "lora_repository_path": "/var/lib/openjiuwen-rl/loras",
        "trajectory_retention_seconds": 604800,
        "task_retention_seconds": 604800,
        "reward_timeout_seconds": 86400,
        "run_retention_seconds": 2592000,
        "retention_sweep_interval_seconds": 60,
        "reward_policy": None,
        "max_body_bytes": 33554432,
        "http_header_timeout_seconds": 10.0,
        "http_keep_alive_seconds": 5.0,
        "http_max_connections": 4096,
        "record_dir": "records",
        "record_max_bytes": 67108864,
        "record_backup_count": 5,
        "log_path": "rl-service.log",
        "log_max_bytes": 10485760,
        "log_backup_count": 5,
        "log_level": "INFO",
        "log_format": "text",
        "rollout": RolloutConfig(),
        "training_policy": TrainingPolicyConfig(),
        "lineages": LineagesConfig(),
        "constrained_samples": ConstrainedSamplesConfig(),
        "workers": "auto",
    }
    assert {name: getattr(config, name) for name in expected} == expected
    assert set(RLServiceConfig.model_fields) == set(expected) | {"redis_url", "judge_api_key"}
    assert isinstance(config.redis_url, SecretStr)
    assert config.redis_url.get_secret_value() == "redis://127.0.0.1:6379/0"
    assert isinstance(config.judge_api_key, SecretStr)
    assert config.judge_api_key.get_secret_value() == ""
    assert config.judge_configured is False
    assert required_votes(config) == 1


def test_config_is_frozen() -> None:
    config = make()
    with pytest.raises(ValidationError):
        config.listen_port = 1  # type: ignore[misc]


@pytest.mark.parametrize("field", sorted(REQUIRED))
def test_required_fields_are_named_when_missing(field: str) -> None:
    data = {k: v for k, v in REQUIRED.items() if k != field}
    with pytest.raises(ConfigError, match=f"{field}: required"):
        config_from_mapping(data)


def test_unknown_key_is_refused() -> None:
    assert "judge_url: unknown key" in error_of(judge_url="http://127.0.0.1:9000")


def test_every_error_is_reported() -> None:
    message = error_of(listen_port=0, model_id="a:b", bogus=1)
    assert "listen_port:" in message and "model_id: must not contain ':'" in message and "bogus: unknown key" in message


# --- process and peers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "127.0.0.2", "127.255.255.254"])
def test_loopback_ip_literals_are_accepted(host: str) -> None:
    assert make(listen_host=host).listen_host == host


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com", "", "128.0.0.1", "::2"])
def test_non_loopback_host_is_refused(host: str) -> None:
    message = error_of(listen_host=host)
    assert "listen_host:" in message and "loopback only" in message


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST", "localhost.", "ip6-localhost", "[::1]", "::1%lo"])
def test_loopback_names_are_refused(host: str) -> None:
    """A name resolves as /etc/hosts and the resolver say (`::1` first on many hosts): only IP literals bind."""
    message = error_of(listen_host=host)
    assert "listen_host:" in message and "IP literal of loopback" in message


@pytest.mark.parametrize("port", [1, 65535])
def test_port_bounds_accepted(port: int) -> None:
    assert make(listen_port=port).listen_port == port


@pytest.mark.parametrize("port", [0, 65536, -1, True, "18081", 18081.0])
def test_bad_port_is_refused(port: Any) -> None:
    assert "listen_port:" in error_of(listen_port=port)


@pytest.mark.parametrize("model_id", ["qwen3-8b", "org/model", "a..b", "m.v2_x"])
def test_valid_model_ids(model_id: str) -> None:
    assert make(model_id=model_id).model_id == model_id


@pytest.mark.parametrize(
    ("model_id", "reason"),
    [
        ("", "must not be blank"),
        ("   ", "must not be blank"),
        ("a b", "must not contain whitespace"),
        ("a\tb", "must not contain whitespace"),
        ("a:b", "must not contain ':'"),
        ("qwen:v1", "must not contain ':'"),
        ("..", "'..' path segment"),
        ("a/../b", "'..' path segment"),
        ("../a", "'..' path segment"),
        ("a\\..\\b", "'..' path segment"),
        ("/abs", "must not start with '/'"),
    ],
)
def test_invalid_model_ids(model_id: str, reason: str) -> None:
    message = error_of(model_id=model_id)
    assert f"model_id: {reason}" in message or ("model_id:" in message and reason in message)


@pytest.mark.parametrize("model_id", [123, 1.5, True, None, ["m"]])
def test_model_id_is_not_coerced(model_id: Any) -> None:
    assert "model_id:" in error_of(model_id=model_id)


@pytest.mark.parametrize("url", ["redis://h:6379/0", "rediss://:pw@h:6380/1", "unix:///run/redis.sock?db=2"])
def test_redis_schemes_accepted(url: str) -> None:
    assert make(redis_url=url).redis_url.get_secret_value() == url


@pytest.mark.parametrize("url", ["http://h:6379", "h:6379", "", "redis:/h", "unix://", 6379])
def test_bad_redis_url_is_refused(url: Any) -> None:
    assert "redis_url:" in error_of(redis_url=url)


@pytest.mark.parametrize("value", ["", "   "])
def test_base_model_path_must_not_be_blank(value: str) -> None:
    assert "base_model_path: must not be blank" in error_of(base_model_path=value)


def test_aigw_endpoint_accepts_http_and_https_and_drops_trailing_slash() -> None:
    assert make(aigw_endpoint="https://gw.local:8443/").aigw_endpoint == "https://gw.local:8443"
    assert make(aigw_endpoint="http://[::1]:8080").aigw_endpoint == "http://[::1]:8080"


@pytest.mark.parametrize("url", ["ftp://h", "127.0.0.1:8080", "http://", "http://h:99999", "http://h/?q=1", ""])
def test_bad_aigw_endpoint_is_refused(url: str) -> None:
    assert "aigw_endpoint:" in error_of(aigw_endpoint=url)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://h :8080", "must be an http(s) URL without whitespace"),
        ("http://h:99999", "must be a valid http(s) URL"),
        ("ftp://h", "must be an http:// or https:// URL with a host"),
        ("http://h/#top", "must be a base URL without query or fragment"),
    ],
)
def test_bad_aigw_endpoint_says_why(url: str, reason: str) -> None:
    assert f"aigw_endpoint: {reason}" in error_of(aigw_endpoint=url)


# --- judge ------------------------------------------------------------------------------------------------------


def test_judge_model_required_with_endpoint() -> None:
    assert "judge_model: required when judge_endpoint is set" in error_of(judge_endpoint="http://127.0.0.1:8000/v1")
    assert "judge_model: required" in error_of(judge_endpoint="http://127.0.0.1:8000", judge_model="  ")


def test_judge_configured_with_endpoint_and_model() -> None:
    config = make(judge_endpoint="http://127.0.0.1:8000/v1", judge_model="judge", judge_api_key=JUDGE_KEY)
    assert config.judge_configured is True
    assert config.judge_api_key.get_secret_value() == JUDGE_KEY


def test_judge_model_alone_is_allowed_without_endpoint() -> None:
    assert make(judge_model="judge").judge_configured is False


@pytest.mark.parametrize("url", ["judge.local", "ftp://judge", "http://"])
def test_bad_judge_endpoint_is_refused(url: str) -> None:
    assert "judge_endpoint:" in error_of(judge_endpoint=url, judge_model="judge")


@pytest.mark.parametrize(("votes", "effective"), [(1, 1), (2, 2), (3, 2), (4, 3), (5, 3)])
def test_effective_min_votes_defaults_to_majority(votes: int, effective: int) -> None:
    assert required_votes(make(judge_votes=votes)) == effective


@pytest.mark.parametrize("min_votes", [1, 2, 3])
def test_min_votes_within_bounds(min_votes: int) -> None:
    config = make(judge_votes=3, judge_min_votes=min_votes)
    assert required_votes(config) == min_votes


@pytest.mark.parametrize("min_votes", [0, -1, 4, True, "2"])
def test_min_votes_out_of_bounds(min_votes: Any) -> None:
    assert "judge_min_votes:" in error_of(judge_votes=3, judge_min_votes=min_votes)


@pytest.mark.parametrize(("field", "value"), [("judge_votes", 0), ("judge_retries", -1), ("judge_votes", True)])
def test_judge_counts(field: str, value: Any) -> None:
    assert f"{field}:" in error_of(**{field: value})


@pytest.mark.parametrize(
    "field", ["judge_timeout", "turn_publish_timeout_seconds", "lora_activation_timeout", "tis_cap"]
)
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), True, "30"])
def test_positive_floats_refuse_bad_values(field: str, value: Any) -> None:
    assert f"{field}:" in error_of(**{field: value})


@pytest.mark.parametrize("field", ["judge_timeout", "turn_publish_timeout_seconds", "lora_activation_timeout"])
def test_positive_floats_accept_ints(field: str) -> None:
    value = getattr(make(**{field: 5}), field)
    assert value == 5.0 and isinstance(value, float)


# --- training ---------------------------------------------------------------------------------------------------


def test_max_samples_must_be_at_least_min() -> None:
    assert "max_samples_per_run: must be >= min_samples_for_training" in error_of(min_samples_for_training=64)
    assert "max_samples_per_run:" in error_of(min_samples_for_training=8, max_samples_per_run=4)
    config = make(min_samples_for_training=8, max_samples_per_run=16)
    assert (config.min_samples_for_training, config.max_samples_per_run) == (8, 16)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("min_samples_for_training", 0),
        ("max_samples_per_run", 0),
        ("lora_activation_attempts", 0),
        ("max_policy_lag", -1),
        ("ppo_samples_per_step", -1),
        ("nproc_per_node", 0),
        ("trainer_backend", "torch"),
        ("trainer_backend", "LOCAL"),
        ("advantage_estimator", "ppo"),
        ("ray_address", 1),
        ("training_tmp_root", ""),
    ],
)
def test_training_fields_refuse_bad_values(field: str, value: Any) -> None:
    assert f"{field}:" in error_of(**{field: value})


def test_training_options_accepted() -> None:
    config = make(
        max_policy_lag=0, trainer_backend="verl", advantage_estimator="grpo", tis_cap=2, ppo_samples_per_step=4
    )
    assert (config.max_policy_lag, config.trainer_backend, config.advantage_estimator) == (0, "verl", "grpo")
    assert config.tis_cap == 2.0 and config.ppo_samples_per_step == 4
    assert make(trainer_backend="scripted").trainer_backend == "scripted"


def test_ppo_config_path_must_exist(tmp_path: Path) -> None:
    assert "ppo_config_path: must be the path of an existing file" in error_of(
        ppo_config_path=str(tmp_path / "missing.yaml")
    )
    assert "ppo_config_path:" in error_of(ppo_config_path=str(tmp_path))  # a directory is not a file
    assert "ppo_config_path:" in error_of(ppo_config_path="")
    existing = write(tmp_path, "actor: {}\n", "ppo.yaml")
    assert make(ppo_config_path=str(existing)).ppo_config_path == str(existing.resolve())


@pytest.mark.parametrize(
    ("value", "stored"), [("", ""), ("0", "0"), ("0,1", "0,1"), (" 2, 3 ", "2,3"), ("10,07", "10,7")]
)
def test_gpu_ids_accepted(value: str, stored: str) -> None:
    assert make(training_gpu_ids=value).training_gpu_ids == stored


@pytest.mark.parametrize("value", ["-1", "a", "0,,1", "0,", "1.5", "0,0", "0;1", 0, "０"])
def test_gpu_ids_refused(value: Any) -> None:
    assert "training_gpu_ids:" in error_of(training_gpu_ids=value)


@pytest.mark.parametrize("path", ["loras", "./loras", "~/loras", ""])
def test_lora_repository_path_must_be_absolute(path: str) -> None:
    assert "lora_repository_path:" in error_of(lora_repository_path=path)


# --- retention, http, logging -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field",
    [
        "trajectory_retention_seconds",
        "task_retention_seconds",
        "reward_timeout_seconds",
        "run_retention_seconds",
        "retention_sweep_interval_seconds",
        "log_max_bytes",
        "log_backup_count",
        "record_max_bytes",
        "record_backup_count",
    ],
)
@pytest.mark.parametrize("value", [0, -5, True, 1.5])
def test_positive_ints_refuse_bad_values(field: str, value: Any) -> None:
    assert f"{field}:" in error_of(**{field: value})
    assert getattr(make(**{field: 1}), field) == 1


def test_max_body_bytes_minimum() -> None:
    assert "max_body_bytes:" in error_of(max_body_bytes=1023)
    assert make(max_body_bytes=1024).max_body_bytes == 1024


def test_log_path_must_not_be_blank() -> None:
    assert "log_path:" in error_of(log_path=" ")


@pytest.mark.parametrize(
    ("value", "stored"),
    [("debug", "DEBUG"), ("Warning", "WARNING"), (" error ", "ERROR"), ("CRITICAL", "CRITICAL")],
)
def test_log_level_normalized(value: str, stored: str) -> None:
    assert make(log_level=value).log_level == stored


@pytest.mark.parametrize("value", ["verbose", "WARN", "NOTSET", "", 20])
def test_log_level_refused(value: Any) -> None:
    assert "log_level:" in error_of(log_level=value)


# --- loader -----------------------------------------------------------------------------------------------------


def test_load_yaml(tmp_path: Path) -> None:
    path = write(tmp_path, yaml.safe_dump({**REQUIRED, "listen_port": 19000, "log_level": "debug"}))
    config = load_config(path)
    assert (config.listen_port, config.log_level, config.model_id) == (19000, "DEBUG", "qwen-agent")
    assert load_config(str(path)) == config


def test_json_file_accepted(tmp_path: Path) -> None:
    path = write(tmp_path, json.dumps({**REQUIRED, "judge_votes": 3}), "rl.json")
    assert load_config(path).judge_votes == 3


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n", "", "# only a comment\n"])
def test_mapping_required(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(write(tmp_path, text))


def test_dotdot_in_path_refused_even_if_the_file_exists(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    write(tmp_path, yaml.safe_dump(REQUIRED))
    with pytest.raises(ConfigError, match=r"'\.\.' components"):
        load_config(tmp_path / "sub" / ".." / "rl.yaml")
    with pytest.raises(ConfigError, match=r"'\.\.' components"):
        load_config(f"{tmp_path}/sub/../rl.yaml")


@pytest.mark.parametrize("path", ["/proc/self/environ", "/proc", "/sys/kernel/hostname", "/dev/null", "/dev/stdin"])
def test_pseudo_filesystems_refused(path: str) -> None:
    with pytest.raises(ConfigError, match="/proc, /sys or /dev"):
        load_config(path)


def test_symlink_into_proc_refused_after_resolving(tmp_path: Path) -> None:
    link = tmp_path / "rl.yaml"
    link.symlink_to("/proc/self/environ")
    with pytest.raises(ConfigError, match="/proc, /sys or /dev"):
        load_config(link)


def test_home_is_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    write(tmp_path, yaml.safe_dump(REQUIRED))
    assert load_config("~/rl.yaml").model_id == "qwen-agent"


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "absent.yaml")


def test_directory_is_not_a_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a regular file"):
        load_config(tmp_path)


@pytest.mark.parametrize("path", ["", "   ", "a\x00b", 42])
def test_bad_path_values(path: Any) -> None:
    with pytest.raises(ConfigError):
        load_config(path)


def test_invalid_yaml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"invalid YAML at line \d+, column \d+: "):
        load_config(write(tmp_path, "model_id: m\nredis_url: [unclosed\n"))


def test_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "rl.yaml"
    path.write_bytes(b"model_id: \xff\xfe\n")
    with pytest.raises(ConfigError, match="UTF-8"):
        load_config(path)


def test_duplicate_keys_refused(tmp_path: Path) -> None:
    text = yaml.safe_dump(REQUIRED) + "model_id: other\n"
    with pytest.raises(ConfigError, match="duplicate key 'model_id'"):
        load_config(write(tmp_path, text))


def test_yaml_merge_keys_still_work(tmp_path: Path) -> None:
    # Only repeated explicit keys are duplicates; an explicit key may override a merged one.
    text = "<<: {judge_votes: 3, judge_retries: 1}\njudge_retries: 0\n" + yaml.safe_dump(REQUIRED)
    config = load_config(write(tmp_path, text))
    assert (config.judge_votes, config.judge_retries) == (3, 0)


def test_error_names_the_field(tmp_path: Path) -> None:
    path = write(tmp_path, yaml.safe_dump({**REQUIRED, "model_id": "qwen:v1"}))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "model_id: must not contain ':'" in str(info.value)
    assert str(path.resolve()) in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unknown_key_in_file_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="listen_addr: unknown key"):
        load_config(write(tmp_path, yaml.safe_dump({**REQUIRED, "listen_addr": "0.0.0.0"})))


# --- secrets ----------------------------------------------------------------------------------------------------


def _full_text(exc: BaseException) -> str:
    """The exception and every exception a traceback would print with it (its cause or unsuppressed context)."""
    parts: list[str] = []
    current: BaseException | None = exc
    while current is not None:
        parts += [str(current), repr(current), *traceback.format_exception_only(current)]
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
    return "".join(parts)


def test_secrets_never_in_repr_or_dump() -> None:
    config = make(
        redis_url=f"redis://:{REDIS_PASSWORD}@127.0.0.1:6379/0",
        judge_endpoint="http://127.0.0.1:8000",
        judge_model="judge",
        judge_api_key=JUDGE_KEY,
    )
    for text in (repr(config), str(config), config.model_dump_json()):
        assert REDIS_PASSWORD not in text and JUDGE_KEY not in text


def test_redis_password_never_in_errors(tmp_path: Path) -> None:
    # Valid Redis URL next to an invalid field, and a password inside an invalid Redis URL.
    for redis_url in (f"redis://:{REDIS_PASSWORD}@h:6379/0", f"http://user:{REDIS_PASSWORD}@h:6379"):
        path = write(tmp_path, yaml.safe_dump({**REQUIRED, "redis_url": redis_url, "listen_host": "0.0.0.0"}))
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert "listen_host:" in str(info.value)
        assert REDIS_PASSWORD not in _full_text(info.value)


def test_judge_api_key_never_in_errors(tmp_path: Path) -> None:
    data = {**REQUIRED, "judge_endpoint": "http://127.0.0.1:8000", "judge_api_key": JUDGE_KEY}  # no judge_model
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, yaml.safe_dump(data)))
    assert "judge_model: required" in str(info.value)
    assert JUDGE_KEY not in _full_text(info.value)


def test_secret_with_wrong_type_not_echoed() -> None:
    with pytest.raises(ConfigError) as info:
        make(judge_api_key=987654321987)
    assert "judge_api_key:" in str(info.value)
    assert "987654321987" not in _full_text(info.value)


def test_yaml_error_does_not_quote_the_line(tmp_path: Path) -> None:
    text = f'redis_url: "redis://:{REDIS_PASSWORD}@h:6379/0\nmodel_id: m\n'  # unterminated quote
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text))
    assert "invalid YAML" in str(info.value)
    assert REDIS_PASSWORD not in _full_text(info.value)


# --- shipped files ----------------------------------------------------------------------------------------------


def test_example_config_loads() -> None:
    config = load_config(EXAMPLE)
    assert config.lora_repository_path == "/var/lib/openjiuwen-rl/loras"
    assert config.judge_configured is False
    data = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))
    # Every field is shown; the judge's model and key are present only as comments.
    assert set(RLServiceConfig.model_fields) - set(data) == {"judge_model", "judge_api_key"}


def test_example_with_judge_uncommented_loads(tmp_path: Path) -> None:
    text = EXAMPLE.read_text(encoding="utf-8").replace('judge_endpoint: ""\n', "")
    for line in ("judge_endpoint:", "judge_model:", "judge_api_key:"):
        text = text.replace(f"# {line}", line)
    config = load_config(write(tmp_path, text))
    assert config.judge_configured and config.judge_model


def test_documentation_lists_every_field() -> None:
    doc = DOC.read_text(encoding="utf-8")
    missing = [name for name in RLServiceConfig.model_fields if f"| `{name}` |" not in doc]
    assert missing == []


def test_constrained_samples_defaults_and_values() -> None:
    """Issue 35: one key per constraint kind (the grammar kinds share `grammar`), defaults as documented; a value
    other than correct/exclude, an unknown key, or `correct` for beam search is refused."""
    assert ConstrainedSamplesConfig().policy() == POLICY_DEFAULTS
    assert {policy_key(kind) for kind in KINDS} == set(POLICY_DEFAULTS)
    assert {policy_key(kind) for kind in GRAMMAR_KINDS} == {"grammar"}
    assert make(constrained_samples={"greedy": "correct"}).constrained_samples.greedy == "correct"
    for bad in ({"greedy": "train"}, {"json_schema": "exclude"}, {"beam_search": "correct"}):
        with pytest.raises(ConfigError, match="constrained_samples"):
            make(constrained_samples=bad)


def test_training_policy_is_off_by_default_and_validated() -> None:
    assert make().training_policy.auto is False
    policy = make(training_policy={"auto": True, "min_pending_samples": 8, "max_wait_seconds": 60,
                                   "min_batch_on_wait": 2, "min_interval_seconds": 0}).training_policy
    assert (policy.auto, policy.min_pending_samples, policy.max_wait_seconds, policy.max_concurrent_runs) == (
        True, 8, 60.0, 1)


@pytest.mark.parametrize(("policy", "message"), [
    ({"min_batch_on_wait": 40}, "training_policy: min_batch_on_wait must be <= min_pending_samples"),
    ({"min_pending_samples": 0}, "training_policy.min_pending_samples"),
    ({"max_concurrent_runs": 0}, "training_policy.max_concurrent_runs"),
    ({"max_concurrent_runs": 65}, "training_policy.max_concurrent_runs"),
    ({"weight": 0}, "training_policy.weight"),
    ({"max_runs_per_hour": 0}, "training_policy.max_runs_per_hour"),
    ({"max_wait_seconds": 60, "min_batch_on_wait": 4, "max_samples_per_run": 3},
     "training_policy: max_samples_per_run must be >= min_batch_on_wait"),
    ({"max_wait_seconds": 0}, "training_policy.max_wait_seconds"),
    ({"min_interval_seconds": -1}, "training_policy.min_interval_seconds"),
    ({"auto": "yes"}, "training_policy.auto"),
    # Per-lineage overrides (docs/lineages.md): names by common/lineage.py, per-line fields only, the merge valid.
    ({"lineages": {"Bad_Name": {}}},
     "training_policy.lineages.Bad_Name.[key]: must be a lineage name other than default"),
    ({"lineages": {"default": {}}},
     "training_policy.lineages.default.[key]: must be a lineage name other than default"),
    ({"lineages": {"up": {"max_concurrent_runs": 2}}}, "training_policy.lineages.up.max_concurrent_runs"),
    ({"lineages": {"up": {"min_pending_samples": 0}}}, "training_policy.lineages.up.min_pending_samples"),
    ({"min_pending_samples": 8, "lineages": {"up": {"min_batch_on_wait": 9}}},
     "lineages.up: min_batch_on_wait must be <= min_pending_samples"),
    ({"lineages": {"up": {"weight": -1.0}}}, "training_policy.lineages.up.weight"),
])
def test_bad_training_policies_are_refused_by_name(policy: dict, message: str) -> None:
    assert message in error_of(training_policy=policy)


def test_concurrent_runs_are_accepted_with_every_backend() -> None:
    """Up to 64 runs at once (training/run_claims.py); verl places each run on its own Ray resources (docs/training.md
    "Concurrent verl runs")."""
    assert make(training_policy={"max_concurrent_runs": 4}).training_policy.max_concurrent_runs == 4
    verl = make(trainer_backend="verl", training_policy={"max_concurrent_runs": 8}, ray_gpus_per_rank=0.5,
                ray_cpus_per_rank=2, ray_placement_timeout_seconds=600)
    assert (verl.training_policy.max_concurrent_runs, verl.ray_gpus_per_rank, verl.ray_cpus_per_rank,
            verl.ray_placement_timeout_seconds) == (8, 0.5, 2.0, 600.0)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"ray_gpus_per_rank": 1.5}, "ray_gpus_per_rank: must be a fraction up to 1 or a whole number"),
    ({"ray_gpus_per_rank": 0}, "ray_gpus_per_rank"),
    ({"ray_gpus_per_rank": "1"}, "ray_gpus_per_rank"),
    ({"ray_cpus_per_rank": 2.5}, "ray_cpus_per_rank: must be a fraction up to 1 or a whole number"),
    ({"ray_cpus_per_rank": -1}, "ray_cpus_per_rank"),
    ({"ray_placement_timeout_seconds": 0}, "ray_placement_timeout_seconds"),
    ({"training_gpu_ids": "0,1", "ray_gpus_per_rank": 1}, "ray_gpus_per_rank: must be null when training_gpu_ids"),
])
def test_bad_ray_resources_are_refused_by_name(overrides: dict, message: str) -> None:
    assert message in error_of(trainer_backend="verl", **overrides)


def test_fair_share_and_quotas_are_per_lineage_fields() -> None:
    policy = make(training_policy={"auto": True, "max_runs_per_hour": 10,
                                   "lineages": {"meek": {"weight": 2.5},
                                                "flood": {"max_runs_per_hour": 2, "max_samples_per_run": 4},
                                                "free": {"max_runs_per_hour": None}}}).training_policy
    meek, flood, free = (policy.for_lineage(name) for name in ("meek", "flood", "free"))
    assert (policy.weight, policy.max_samples_per_run) == (1.0, None)
    assert (meek.weight, meek.max_runs_per_hour) == (2.5, 10)  # the top-level quota inherited
    assert (flood.weight, flood.max_runs_per_hour, flood.max_samples_per_run) == (1.0, 2, 4)
    assert free.max_runs_per_hour is None  # an explicit null lifts the top-level quota


def test_training_policy_lineage_override_is_merged_field_by_field() -> None:
    policy = make(training_policy={"auto": True, "min_pending_samples": 8, "max_wait_seconds": 60,
                                   "lineages": {"up": {"min_pending_samples": 2},
                                                "off": {"auto": False, "max_wait_seconds": None}}}).training_policy
    up, off, other = (policy.for_lineage(name) for name in ("up", "off", "down"))
    assert (up.auto, up.min_pending_samples, up.max_wait_seconds) == (True, 2, 60.0)  # the rest inherited
    assert (off.auto, off.min_pending_samples, off.max_wait_seconds) == (False, 8, None)  # explicit null kept
    assert other is policy and policy.for_lineage("default") is policy
    # Overrides alone may switch automatic training on: the scheduler runs for those lineages only.
    only = make(training_policy={"lineages": {"up": {"auto": True}}}).training_policy
    assert (only.auto, only.any_auto, only.for_lineage("up").auto) == (False, True, True)
