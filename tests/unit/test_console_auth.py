"""Web console credentials (gateway/console/console_auth.py): single-use login tokens and session cookies, with the
clock as an argument; and `openjiuwen-rl rl console url`, whose link the gateway accepts."""

from __future__ import annotations

import time

import pytest

from openjiuwen.agent_evolving.agent_rl.cli.operator import KEY_ENV, main
from openjiuwen.agent_evolving.agent_rl.gateway.console.console_auth import (
    MAX_LOGIN_TTL_MS,
    ConsoleAuth,
    login_token,
)
from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import signature

KEY = b"k" * 32
NOW = 1_800_000_000_000


def test_a_login_token_is_accepted_once() -> None:
    auth = ConsoleAuth(KEY)
    token = login_token(KEY, expires_ms=NOW + 60_000)
    assert auth.redeem(token, now_ms=NOW)
    assert not auth.redeem(token, now_ms=NOW + 1)
    assert auth.redeem(login_token(KEY, expires_ms=NOW + 60_001), now_ms=NOW + 2)  # another token is fine


@pytest.mark.parametrize("token", [
    login_token(KEY, expires_ms=NOW),  # expires now
    login_token(KEY, expires_ms=NOW - 1),
    login_token(KEY, expires_ms=NOW + MAX_LOGIN_TTL_MS + 1),  # would be a standing password
    login_token(b"x" * 32, expires_ms=NOW + 60_000),  # another key
    f"{NOW + 60_000}.{signature(KEY, str(NOW + 60_000), b'')}",  # a control-request signature: another domain
    f"{NOW + 60_001}.{login_token(KEY, expires_ms=NOW + 60_000).split('.')[1]}",  # expiry moved
    login_token(KEY, expires_ms=NOW + 60_000).upper(),
    "", "garbage", None, 17, ["a"],
])
def test_bad_login_tokens_are_refused(token: object) -> None:
    assert not ConsoleAuth(KEY).redeem(token, now_ms=NOW)


def test_used_tokens_are_forgotten_after_expiry_and_the_cache_fails_closed_when_full() -> None:
    auth = ConsoleAuth(KEY, used_capacity=2)
    assert auth.redeem(login_token(KEY, expires_ms=NOW + 10), now_ms=NOW)
    assert auth.redeem(login_token(KEY, expires_ms=NOW + 20), now_ms=NOW)
    assert not auth.redeem(login_token(KEY, expires_ms=NOW + 30), now_ms=NOW)  # full of live tokens
    assert auth.redeem(login_token(KEY, expires_ms=NOW + 30), now_ms=NOW + 15)  # the first one expired: room


def test_session_cookies_verify_until_they_expire() -> None:
    auth = ConsoleAuth(KEY, session_ttl_ms=1000)
    cookie, max_age_s = auth.issue(now_ms=NOW)
    assert max_age_s == 1
    assert auth.session_ok(cookie, now_ms=NOW + 999)
    assert not auth.session_ok(cookie, now_ms=NOW + 1000)
    assert ConsoleAuth(KEY).session_ok(cookie, now_ms=NOW)  # any gateway holding the key: stateless
    assert cookie != auth.issue(now_ms=NOW)[0]  # a fresh nonce each time


def test_forged_and_tampered_cookies_are_refused() -> None:
    cookie, _ = ConsoleAuth(KEY).issue(now_ms=NOW)
    expires, nonce, mac = cookie.split(".")
    token = login_token(KEY, expires_ms=NOW + 60_000)
    for bad in (ConsoleAuth(b"x" * 32).issue(now_ms=NOW)[0], f"{int(expires) + 1}.{nonce}.{mac}",
                f"{expires}.{'0' * 32}.{mac}", f"{expires}.{nonce}.{'0' * 64}", f"{expires}.{nonce}", token, "",
                None):
        assert not ConsoleAuth(KEY).session_ok(bad, now_ms=NOW), bad


def test_keys_never_show_in_the_repr() -> None:
    assert "k" * 32 not in repr(ConsoleAuth(KEY))
    with pytest.raises(ValueError):
        ConsoleAuth(b"")


def test_console_url_prints_a_link_the_gateway_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["console", "url", "--url", "http://gw:9000/", "--ttl", "120"], env={KEY_ENV: KEY.decode()})
    out = capsys.readouterr()
    assert code == 0
    link = out.out.strip()
    prefix = "http://gw:9000/console/login#token="
    assert link.startswith(prefix)
    token = link[len(prefix):]
    expires_ms = int(token.split(".")[0])
    assert 115_000 <= expires_ms - time.time() * 1000 <= 120_000
    assert ConsoleAuth(KEY).redeem(token, now_ms=int(time.time() * 1000))
    assert "single use" in out.err and KEY.decode() not in out.out + out.err


@pytest.mark.parametrize("ttl", ["0", "-5", str(MAX_LOGIN_TTL_MS // 1000 + 1)])
def test_console_url_refuses_a_bad_ttl(ttl: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["console", "url", "--ttl", ttl], env={KEY_ENV: KEY.decode()}) == 2
    assert "--ttl" in capsys.readouterr().err
