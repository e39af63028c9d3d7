"""One notion of loopback for both processes (common/loopback.py): IP literals of 127.0.0.0/8 and ::1, never names."""

from __future__ import annotations

import pytest

from openjiuwen.agent_evolving.agent_rl.common.loopback import ip_literal, is_loopback_ip


@pytest.mark.parametrize("text", ["127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "::ffff:127.0.0.1"])
def test_loopback_ip_literals(text: str) -> None:
    assert is_loopback_ip(text)


@pytest.mark.parametrize("text", ["localhost", "LOCALHOST", "localhost.", "ip6-localhost", "[::1]", "::1%lo",
                                  "0.0.0.0", "::", "128.0.0.1", "::2", "10.0.0.1", "::ffff:10.0.0.1", "", "testclient"])
def test_everything_else_is_not_loopback(text: str) -> None:
    assert not is_loopback_ip(text)


def test_names_are_not_ip_literals_at_all() -> None:
    """The request guard tells a name (an in-process transport: local by construction) from a non-loopback IP."""
    assert ip_literal("localhost") is None and ip_literal("testclient") is None
    assert str(ip_literal("::ffff:127.0.0.1")) == "127.0.0.1"
