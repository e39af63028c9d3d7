"""The config toolkit both processes' configs share (issue 39 item 5: each kept its own copy): the base of every
config model, the one validation entry point, the constrained types both spell, and validation messages that name
each offending field and never its value (values may be secrets)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar
from urllib.parse import SplitResult, urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError
from pydantic_core import PydanticCustomError

from .lineage import DEFAULT_LINEAGE, is_lineage

ConfigT = TypeVar("ConfigT", bound=BaseModel)


class ConfigModel(BaseModel):
    """Every config model of both processes: unknown keys refused (a typo must not be ignored), frozen once parsed.
    `model_` field names are allowed (`model_id`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


def _describe(error: Mapping[str, Any]) -> str:
    loc = ".".join(str(part) for part in error.get("loc", ())) or "config"
    if error.get("type") == "extra_forbidden":
        return f"{loc}: unknown key"
    if error.get("type") == "missing":
        return f"{loc}: required"
    return f"{loc}: {error.get('msg', 'invalid value')}"


def validation_problems(exc: ValidationError) -> str:
    """`field: problem; …` built from locations and messages only: str(exc) would echo input values (secrets)."""
    return "; ".join(
        _describe(e) for e in exc.errors(include_url=False, include_input=False, include_context=False)
    )


def validate_config(model: type[ConfigT], data: Any, *, source: str, error: type[ValueError], shape: str) -> ConfigT:
    """`data` (already parsed) validated as `model`; `error` naming `source` and each offending field, never a value.

    :param shape: what the document must be, e.g. "a JSON object".
    """
    if not isinstance(data, Mapping):
        raise error(f"{source}: must be {shape}, got {type(data).__name__}")
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        problems = validation_problems(exc)  # never the values: a password or a key may be one
    raise error(f"{source}: {problems}")


def config_invalid(message: str) -> PydanticCustomError:
    """The error a config validator raises: every config model (both processes') uses this one. A fixed message:
    pydantic then reports it verbatim, without the "Value error, " prefix or the input (which may be a secret)."""
    return PydanticCustomError("config_invalid", message)


def check_non_blank(value: str) -> str:
    if not value.strip():
        raise config_invalid("must not be blank")
    return value


def check_absolute_path(value: str) -> str:
    check_non_blank(value)
    if "\x00" in value or not os.path.isabs(value):
        raise config_invalid("must be an absolute path")
    return value


def check_model_id(value: str) -> str:
    if not value.strip():
        raise config_invalid("must not be blank")
    if any(c.isspace() for c in value):
        raise config_invalid("must not contain whitespace")
    if ":" in value:
        raise config_invalid("must not contain ':'")
    if value.startswith("/"):
        raise config_invalid("must not start with '/'")
    if ".." in value.replace("\\", "/").split("/"):
        raise config_invalid("must not contain a '..' path segment")
    return value


def split_url(value: str, *, whitespace: str, malformed: str) -> SplitResult:
    """A configured URL's parts, refused (with the caller's messages) when it holds whitespace or its port is bad;
    each process then applies its own rules on scheme and host."""
    if any(c.isspace() for c in value):
        raise config_invalid(whitespace)
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        raise config_invalid(malformed) from None
    return parts


def check_named_lineage(value: str) -> str:
    if not is_lineage(value) or value == DEFAULT_LINEAGE:
        raise config_invalid("must be a lineage name other than default (lower-case letters, digits and '-', "
                             "1-63 characters, not 'v' followed by digits)")
    return value


NonBlank = Annotated[StrictStr, AfterValidator(check_non_blank)]
AbsolutePath = Annotated[StrictStr, AfterValidator(check_absolute_path)]

# The RL Service's `model_id` and the gateway's `onlineRL.modelId`: it names Redis ownership and LoRA directories.
ModelId = Annotated[StrictStr, AfterValidator(check_model_id)]

# A lineage a setting names apart from `default` (the top-level setting is default's own): the gateway's
# `lora.openLineages`, the keys of `reward_policy.lineages` and `training_policy.lineages`.
NamedLineage = Annotated[StrictStr, AfterValidator(check_named_lineage)]

PositiveInt = Annotated[StrictInt, Field(ge=1)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
# Strict floats still accept ints (30 → 30.0) but never bools or strings.
PositiveFloat = Annotated[float, Field(gt=0, strict=True, allow_inf_nan=False)]
UnitInterval = Annotated[float, Field(ge=0, le=1, strict=True, allow_inf_nan=False)]
# How often a background loop wakes (reward sweeper, rollout decisions, training scheduler): at least once an hour.
LoopIntervalSeconds = Annotated[float, Field(gt=0, le=3600, strict=True, allow_inf_nan=False)]
# The bound on a request (or an upstream answer) body either HTTP server buffers.
BodyLimitBytes = Annotated[StrictInt, Field(ge=1024)]
# Open connections either HTTP server keeps before closing the oldest without a complete request head.
ConnectionCap = Annotated[StrictInt, Field(ge=16)]
# Lineages with their own `lineage` metric label beside `default` (common/lineage_labels.py; 0: all of them).
LineageLabelTopK = Annotated[StrictInt, Field(ge=0, le=1000)]
