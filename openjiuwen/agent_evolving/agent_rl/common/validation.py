"""Validation messages that name each offending field and never its value (values may be secrets)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import AfterValidator, StrictStr, ValidationError
from pydantic_core import PydanticCustomError


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


# Shared by both processes' configs (issue 39 item 5: each kept its own copy).
NonBlank = Annotated[StrictStr, AfterValidator(check_non_blank)]
AbsolutePath = Annotated[StrictStr, AfterValidator(check_absolute_path)]

# The RL Service's `model_id` and the gateway's `onlineRL.modelId`: it names Redis ownership and LoRA directories.
ModelId = Annotated[StrictStr, AfterValidator(check_model_id)]
