"""State machines as data: a table of the moves each state allows, and the error a forbidden move raises.

A table is checked where a record changes state; a forbidden move is a bug in the caller (the transactions read the
current state first), so it raises `IllegalTransition` instead of writing a record no reader expects.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Generic, TypeVar

S = TypeVar("S", bound=StrEnum)


class IllegalTransition(RuntimeError):
    """A move its state machine's table does not allow."""

    def __init__(self, machine: str, old: str, new: str) -> None:
        super().__init__(f"illegal {machine} transition {old} -> {new}")
        self.machine = machine
        self.old = old
        self.new = new


class Transitions(Generic[S]):
    """The moves of one state machine; a state with no moves is terminal."""

    def __init__(self, machine: str, table: Mapping[S, Iterable[S]]) -> None:
        self.machine = machine
        self._next: dict[S, frozenset[S]] = {state: frozenset(moves) for state, moves in table.items()}

    def allows(self, old: str, new: str) -> bool:
        return new in self._next.get(old, frozenset())  # type: ignore[call-overload]

    def check(self, old: str, new: str) -> str:
        """`new` when `old → new` is in the table; else IllegalTransition."""
        if not self.allows(old, new):
            raise IllegalTransition(self.machine, str(old), str(new))
        return new

    def terminal(self, state: str) -> bool:
        return not self._next.get(state)  # type: ignore[call-overload]
