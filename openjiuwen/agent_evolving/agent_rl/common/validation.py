"""Validation messages that name each offending field and never its value (values may be secrets)."""

from __future__ import annotations

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


def _invalid(message: str) -> PydanticCustomError:
    # A fixed message: pydantic then reports it verbatim, without the "Value error, " prefix or the input.
    return PydanticCustomError("config_invalid", message)


def check_model_id(value: str) -> str:
    if not value.strip():
        raise _invalid("must not be blank")
    if any(c.isspace() for c in value):
        raise _invalid("must not contain whitespace")
    if ":" in value:
        raise _invalid("must not contain ':'")
    if value.startswith("/"):
        raise _invalid("must not start with '/'")
    if ".." in value.replace("\\", "/").split("/"):
        raise _invalid("must not contain a '..' path segment")
    return value


# The RL Service's `model_id` and the gateway's `onlineRL.modelId`: it names Redis ownership and LoRA directories.
ModelId = Annotated[StrictStr, AfterValidator(check_model_id)]
