"""What every compatibility agent shares: the task (the weather in Paris), its tool and its output model."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

QUESTION = "What is the weather in Paris? Use the tool."
SYSTEM = "You are a helpful weather assistant."


class Weather(BaseModel):
    """The structured answer."""

    city: str
    temperature_c: int
    sunny: bool


def get_weather(city: str) -> str:
    """Current weather of a city."""
    return f"sunny, 21 C in {city}"


WEATHER_PARAMETERS = {
    "type": "object", "properties": {"city": {"type": "string", "description": "the city"}}, "required": ["city"],
}


class Forecast(BaseModel):
    """A structured answer a small model can finish under a grammar: an enum and a boolean (the real-vLLM run)."""

    city: Literal["Paris", "Rome", "Hangzhou"]
    sunny: bool
