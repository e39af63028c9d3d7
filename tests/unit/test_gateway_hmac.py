"""HMAC-signed control (CONTRACT §3.2): signature versions, skew window, per-key replay caches, the instance key and
agent keys. The clock is injected."""

from __future__ import annotations

import hashlib
import hmac
import logging

import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.auth import hmac_auth
from openjiuwen.agent_evolving.agent_rl.gateway.auth.hmac_auth import (
    INSTANCE,
    OPERATOR,
    REPLAY_CAPACITY,
    Caller,
    HmacVerifier,
    KeyRole,
)
from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import (
    CURRENT_VERSION,
    KEY_ID_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    VERSION_HEADER,
    RequestSigner,
    sign,
    sign_request,
)
from openjiuwen.agent_evolving.agent_rl.common.signing_keys import SigningKey
from tests.support.replay_caches import replay_capacity_by_key, replay_entries_by_key

API = b"a" * 32
INS = b"i" * 32
AGENTS = {"support-bot": b"s" * 32, "sales-bot": b"b" * 32}
NOW = 1_735_787_045_123  # 2025-01-02T03:04:05.123Z in ms
SKEW = 300_000
BODY = b'{"reward_mode": "terminal"}'
METHOD, TARGET = "POST", "/v1/rl/tasks/start"


def headers(key: bytes = API, body: bytes = BODY, at: int = NOW, method: str = METHOD,
            target: str = TARGET, key_id: str | None = None, session: str | None = None) -> tuple[str, str]:
    h = sign_request(key, method, target, body, now_ms=at, key_id=key_id, session_id=session)
    return h[TIMESTAMP_HEADER], h[SIGNATURE_HEADER]


def check(verifier: HmacVerifier, ts: str | None, body: bytes, sig: str | None, *, now_ms: int = NOW,
          allow_ins: bool = False, method: str = METHOD, target: str = TARGET, key_id: str | None = None,
          session: bytes = b"") -> Caller | None:
    return verifier.verify(ts, body, sig, now_ms=now_ms, allow_ins=allow_ins, method=method, target=target,
                           version=CURRENT_VERSION, key_id=key_id, session_id=session)


# ---------------------------------------------------------------------------------------------- formats


def test_sign_request_matches_the_version_3_formula():
    h = sign_request(API, "post", "/v1/rl/tasks?limit=5", BODY, now_ms=NOW)
    assert set(h) == {"X-Timestamp", "X-Signature", "X-Signature-Version"}
    assert (h["X-Timestamp"], h["X-Signature-Version"]) == (str(NOW), "3")
    message = b"OJRL-HMAC-V3\nPOST\n/v1/rl/tasks?limit=5\n" + str(NOW).encode() + b"\n\n\n" + BODY
    assert h["X-Signature"] == hmac.new(API, message, hashlib.sha256).hexdigest()
    # An agent key's request names the key in X-Key-Id; both it and the session header are signed.
    h = sign_request(AGENTS["support-bot"], "POST", TARGET, BODY, now_ms=NOW, key_id="support-bot", session_id="s1")
    assert set(h) == {"X-Timestamp", "X-Signature", "X-Signature-Version", "X-Key-Id"}
    assert h[KEY_ID_HEADER] == "support-bot"
    message = b"OJRL-HMAC-V3\nPOST\n" + TARGET.encode() + b"\n" + str(NOW).encode() + b"\nsupport-bot\ns1\n" + BODY
    assert h["X-Signature"] == hmac.new(AGENTS["support-bot"], message, hashlib.sha256).hexdigest()


def test_version_3_binds_the_session_header():
    """Issue 28 item 7: an intercepted Task start re-targeted to another session (or to none) is refused."""
    ts, sig = headers(session="s1")
    for session in (b"victim", b"", b"s1 ", b"S1"):
        assert not check(HmacVerifier(API), ts, BODY, sig, session=session), session
    assert check(HmacVerifier(API), ts, BODY, sig, session=b"s1") == OPERATOR


def test_version_2_signatures_are_refused():
    """Version 2 left the session unsigned: a client still sending it is refused, never half-checked."""
    timestamp = str(NOW)
    message = b"OJRL-HMAC-V2\nPOST\n" + TARGET.encode() + b"\n" + timestamp.encode() + b"\n" + BODY
    sig = hmac.new(API, message, hashlib.sha256).hexdigest()
    for verifier in (HmacVerifier(API), HmacVerifier(API, accept_legacy=True)):
        for version in ("2", CURRENT_VERSION):
            assert not verifier.verify(timestamp, BODY, sig, now_ms=NOW, method=METHOD, target=TARGET,
                                       version=version)


def test_sign_matches_the_aigw_formula():
    h = sign(API, BODY, now_ms=NOW)
    assert set(h) == {"X-Timestamp", "X-Signature"}
    assert h["X-Timestamp"] == str(NOW)
    assert h["X-Signature"] == hmac.new(API, str(NOW).encode() + BODY, hashlib.sha256).hexdigest()
    assert h["X-Signature"] == h["X-Signature"].lower() and len(h["X-Signature"]) == 64


def test_good_signature():
    ts, sig = headers()
    assert check(HmacVerifier(API), ts, BODY, sig)


def test_version_3_binds_method_path_and_query():
    """The attack the AIGW form allows: a captured signed request replayed once on another route or method."""
    ts, sig = headers(body=b"", method="GET", target="/v1/rl/service")
    for method, target in (("POST", "/v1/rl/service/stop"), ("GET", "/v1/rl/service?x=1"), ("POST", "/v1/rl/service"),
                           ("GET", "/v1/rl/service/"), ("GET", "/v1/rl/%73ervice")):
        assert not check(HmacVerifier(API), ts, b"", sig, method=method, target=target), (method, target)
    assert check(HmacVerifier(API), ts, b"", sig, method="GET", target="/v1/rl/service")


def test_the_aigw_form_only_where_configured():
    h = sign(API, BODY, now_ms=NOW)
    strict, legacy = HmacVerifier(API), HmacVerifier(API, accept_legacy=True)
    for version in (None, "1"):
        assert not strict.verify(h[TIMESTAMP_HEADER], BODY, h[SIGNATURE_HEADER], now_ms=NOW, version=version)
    assert legacy.verify(h[TIMESTAMP_HEADER], BODY, h[SIGNATURE_HEADER], now_ms=NOW)
    assert not legacy.verify(h[TIMESTAMP_HEADER], BODY, h[SIGNATURE_HEADER], now_ms=NOW, version="1")  # replay
    # Version 3 works on both; an AIGW signature presented as version 3 (or the reverse) does not match.
    ts, sig = headers(at=NOW + 1)
    assert check(legacy, ts, BODY, sig)
    assert not legacy.verify(ts, BODY, sig, now_ms=NOW, version=None)
    h2 = sign(API, BODY, now_ms=NOW + 2)
    assert not check(legacy, h2[TIMESTAMP_HEADER], BODY, h2[SIGNATURE_HEADER])


@pytest.mark.parametrize("version", ["2", "4", "", "03", "3 ", "v3"])
def test_unknown_versions_refused(version: str):
    ts, sig = headers()
    verifier = HmacVerifier(API, accept_legacy=True)
    assert not verifier.verify(ts, BODY, sig, now_ms=NOW, method=METHOD, target=TARGET, version=version)


def test_version_3_needs_a_method_and_a_printable_target():
    ts, sig = headers()
    verifier = HmacVerifier(API)
    assert not verifier.verify(ts, BODY, sig, now_ms=NOW, version="3")  # no method, no target
    assert not verifier.verify(ts, BODY, sig, now_ms=NOW, version="3", method="POST\nX", target=TARGET)
    assert not verifier.verify(ts, BODY, sig, now_ms=NOW, version="3", method=METHOD, target="/é")


def test_verify_request_reads_the_headers_case_insensitively():
    import httpx

    request = httpx.Request("GET", "http://gw/v1/rl/tasks", params={"status": "active", "limit": 5})
    RequestSigner(API).sign_httpx(request)
    assert request.headers[VERSION_HEADER] == "3"
    assert HmacVerifier(API).verify_request("GET", request.url.raw_path, request.headers, b"",
                                            now_ms=int(request.headers["x-timestamp"])) == OPERATOR


def test_the_signer_covers_the_session_header_it_sends_and_verify_request_reads_it():
    import httpx

    request = httpx.Request("POST", "http://gw/v1/rl/tasks/start", content=BODY,
                            headers={"X-Agent-Session-Id": "s1", "content-type": "application/json"})
    RequestSigner(SigningKey(AGENTS["support-bot"], "support-bot")).sign_httpx(request)
    now_ms = int(request.headers["x-timestamp"])
    retargeted = httpx.Headers(request.headers)
    retargeted["X-Agent-Session-Id"] = "victim"
    verifier = HmacVerifier(API, agent_keys=AGENTS)
    assert verifier.verify_request("POST", request.url.raw_path, retargeted, BODY, now_ms=now_ms) is None
    assert verifier.verify_request("POST", request.url.raw_path, request.headers, BODY,
                                   now_ms=now_ms) == Caller(KeyRole.AGENT, "support-bot")


def test_a_signed_header_sent_twice_is_refused():
    """The gateway acts on one session header: the signature must cover the only one there is."""
    import httpx

    request = httpx.Request("POST", "http://gw/v1/rl/tasks/start", content=BODY, headers={"X-Agent-Session-Id": "s1"})
    RequestSigner(API).sign_httpx(request)
    now_ms = int(request.headers["x-timestamp"])
    for name, value in (("X-Agent-Session-Id", "victim"), ("X-Agent-Session-Id", "s1"), ("X-Key-Id", "sales-bot"),
                        ("X-Signature-Version", "3"), ("X-Timestamp", str(now_ms))):
        doubled = httpx.Headers(list(request.headers.raw) + [(name.encode(), value.encode())])
        assert HmacVerifier(API, agent_keys=AGENTS).verify_request(
            "POST", request.url.raw_path, doubled, BODY, now_ms=now_ms) is None, name
    with pytest.raises(ValueError):  # and the signer never signs such a request
        RequestSigner(API).sign_httpx(httpx.Request("POST", "http://gw/x", headers=[
            ("X-Agent-Session-Id", "a"), ("X-Agent-Session-Id", "b")]))


def test_request_signer_timestamps_strictly_increase():
    signer = RequestSigner(API)
    stamps = [int(signer.headers("GET", "/v1/rl/service")[TIMESTAMP_HEADER]) for _ in range(50)]
    assert stamps == sorted(set(stamps))
    assert "aaaa" not in repr(signer)


# ---------------------------------------------------------------------------------------------- checks


def test_empty_body_for_bodiless_requests():
    ts, sig = headers(body=b"")
    verifier = HmacVerifier(API)
    assert not check(verifier, ts, b"{}", sig)  # the body is part of the signature
    assert check(verifier, ts, b"", sig)


def test_forged_and_wrong_key():
    verifier = HmacVerifier(API, INS)
    ts, sig = headers()
    assert not check(verifier, ts, BODY + b" ", sig)  # body changed
    assert not check(verifier, str(NOW + 1), BODY, sig)  # timestamp changed
    flipped = ("0" if sig[0] != "0" else "1") + sig[1:]
    assert not check(verifier, ts, BODY, flipped)
    ts_b, sig_b = headers(key=b"b" * 32)
    assert not check(verifier, ts_b, BODY, sig_b)
    assert verifier.replay_entries == 0  # nothing unauthenticated is remembered


def test_uppercase_or_malformed_signature_refused():
    verifier = HmacVerifier(API)
    ts, sig = headers()
    for bad in (sig.upper(), sig[:-1], sig + "0", "", " " + sig[1:], "g" * 64):
        assert not check(verifier, ts, BODY, bad)
    assert check(verifier, ts, BODY, sig)


@pytest.mark.parametrize("offset", [SKEW + 1, -(SKEW + 1), 3_600_000, -3_600_000])
def test_stale_and_future_timestamps(offset: int):
    ts, sig = headers(at=NOW + offset)
    assert not check(HmacVerifier(API), ts, BODY, sig)


@pytest.mark.parametrize("offset", [SKEW, -SKEW, 0])
def test_edges_of_the_window_accepted(offset: int):
    ts, sig = headers(at=NOW + offset)
    assert check(HmacVerifier(API), ts, BODY, sig)


@pytest.mark.parametrize("ts", ["", "-1735787045123", "+1735787045123", "1735787045123.0", "1.7e12", " 1735787045123",
                                "1735787045123 ", "0x1", "١٧٣٥٧٨٧٠٤٥١٢٣", "１７３５７８７０４５１２３", "9" * 40])
def test_non_digit_timestamps(ts: str):
    sig = hmac.new(API, ts.encode() + BODY, hashlib.sha256).hexdigest()
    assert not HmacVerifier(API, accept_legacy=True).verify(ts, BODY, sig, now_ms=NOW)


def test_missing_headers():
    ts, sig = headers()
    verifier = HmacVerifier(API)
    assert not check(verifier, None, BODY, sig)
    assert not check(verifier, ts, BODY, None)
    assert not check(verifier, None, BODY, None)


def test_replay_rejected():
    verifier = HmacVerifier(API)
    ts, sig = headers()
    assert check(verifier, ts, BODY, sig)
    assert not check(verifier, ts, BODY, sig)
    # Another request in the same millisecond has another body, hence another signature: accepted.
    other = b'{"reward_mode": "delayed_feedback"}'
    ts2, sig2 = headers(body=other)
    assert check(verifier, ts2, other, sig2, now_ms=NOW + 1)
    assert verifier.replay_entries == 2
    assert not check(verifier, ts, BODY, sig, now_ms=NOW + SKEW)  # still inside the window
    # Past the window the pairs are forgotten, and the timestamp is stale anyway.
    assert not check(verifier, ts, BODY, sig, now_ms=NOW + SKEW + 1)
    assert verifier.replay_entries == 0


def test_clock_stepping_back_does_not_reopen_evicted_replays():
    verifier = HmacVerifier(API)
    ts, sig = headers()
    assert check(verifier, ts, BODY, sig)
    later_ts, later_sig = headers(at=NOW + SKEW + 10)
    assert check(verifier, later_ts, BODY, later_sig, now_ms=NOW + SKEW + 10)  # evicts the first pair
    assert not check(verifier, ts, BODY, sig)  # the clock went back: still refused


def test_cache_stays_bounded():
    verifier = HmacVerifier(API, replay_capacity=50)
    # A steady stream over 20 windows: expired entries leave as fast as new ones arrive.
    step = SKEW // 10
    for i in range(200):
        at = NOW + i * step
        ts, sig = headers(at=at)
        assert check(verifier, ts, BODY, sig, now_ms=at)
        assert verifier.replay_entries <= 11
    # A burst inside one window beyond the capacity is refused (fail closed), never grows the cache.
    at = NOW + 200 * step
    burst = [headers(body=str(i).encode(), at=at) for i in range(60)]
    results = [bool(check(verifier, ts, str(i).encode(), sig, now_ms=at)) for i, (ts, sig) in enumerate(burst)]
    # 10 pairs of the last window are still live, so 40 more fit.
    assert results == [True] * 40 + [False] * 20
    assert verifier.replay_entries == 50
    # Once the window has passed, the cache drains and requests pass again.
    later = at + SKEW + 1
    ts, sig = headers(at=later)
    assert check(verifier, ts, BODY, sig, now_ms=later)
    assert verifier.replay_entries == 1


def test_instance_key_only_with_allow_ins():
    verifier = HmacVerifier(API, INS)
    ts, sig = headers(key=INS)
    assert not check(verifier, ts, BODY, sig)
    assert check(verifier, ts, BODY, sig, allow_ins=True)
    ts, sig = headers(key=API, at=NOW + 1)
    assert check(verifier, ts, BODY, sig, allow_ins=True)  # the api key works there too
    ts, sig = headers(key=INS, at=NOW + 2)
    assert not check(HmacVerifier(API), ts, BODY, sig, allow_ins=True)  # no instance key configured


def test_an_agent_key_is_checked_under_its_own_id_only():
    """Issue 28 item 3: an agent key signs as that agent, never as the operator or another agent."""
    verifier = HmacVerifier(API, INS, agent_keys=AGENTS)
    ts, sig = headers(key=AGENTS["support-bot"], key_id="support-bot")
    assert check(verifier, ts, BODY, sig, key_id="support-bot") == Caller(KeyRole.AGENT, "support-bot")
    ts, sig = headers(key=AGENTS["support-bot"], key_id="support-bot", at=NOW + 1)
    assert not check(verifier, ts, BODY, sig, key_id="sales-bot")  # named as another agent
    assert not check(verifier, ts, BODY, sig, key_id="nobody")  # an unknown id
    assert not check(verifier, ts, BODY, sig, allow_ins=True)  # no key id: only the api and instance keys are tried
    ts, sig = headers(key=AGENTS["support-bot"], at=NOW + 2)  # signed without its id: a different message
    assert not check(verifier, ts, BODY, sig, key_id="support-bot")
    ts, sig = headers(key=API, key_id="support-bot", at=NOW + 3)  # the operator key under an agent's id
    assert not check(verifier, ts, BODY, sig, key_id="support-bot")
    ts, sig = headers(key=API, at=NOW + 4)
    assert check(verifier, ts, BODY, sig) == OPERATOR
    ts, sig = headers(key=INS, at=NOW + 5)
    assert check(verifier, ts, BODY, sig, allow_ins=True) == INSTANCE


def test_the_aigw_form_never_carries_an_agent_key():
    verifier = HmacVerifier(API, agent_keys=AGENTS, accept_legacy=True)
    h = sign(AGENTS["support-bot"], BODY, now_ms=NOW)
    assert not verifier.verify(h[TIMESTAMP_HEADER], BODY, h[SIGNATURE_HEADER], now_ms=NOW, key_id="support-bot")


def test_each_agent_key_has_its_own_replay_cache():
    verifier = HmacVerifier(API, INS, agent_keys=AGENTS, replay_capacity=5)
    results = []
    for i in range(8):
        body = b'{"n": %d}' % i
        ts, sig = headers(key=AGENTS["sales-bot"], body=body, key_id="sales-bot")
        results.append(bool(check(verifier, ts, body, sig, key_id="sales-bot")))
    assert results == [True] * 5 + [False] * 3
    assert replay_entries_by_key(verifier) == {"api": 0, "instance": 0, "agent:support-bot": 0, "agent:sales-bot": 5}
    ts, sig = headers(key=AGENTS["support-bot"], key_id="support-bot")
    assert check(verifier, ts, BODY, sig, key_id="support-bot")  # another agent is not affected
    ts, sig = headers()
    assert check(verifier, ts, BODY, sig) == OPERATOR  # nor the operator


# ---------------------------------------------------------------------------------------------- per-key caches


def flood_instance_key(verifier: HmacVerifier, count: int, at: int) -> list[bool]:
    results = []
    for i in range(count):
        body = b'{"name": "junk-%d"}' % i
        ts, sig = headers(key=INS, body=body, at=at, target="/aigw/v1/register-instance")
        results.append(bool(check(verifier, ts, body, sig, now_ms=at, allow_ins=True,
                                  target="/aigw/v1/register-instance")))
    return results


def test_instance_key_flood_cannot_refuse_operator_requests():
    """The attack of issue 19 item 3, at a small size: the instance key's cache fills, the api key's does not."""
    verifier = HmacVerifier(API, INS, replay_capacity=20)
    assert flood_instance_key(verifier, 30, NOW) == [True] * 20 + [False] * 10
    assert replay_entries_by_key(verifier) == {"api": 0, "instance": 20}
    for i in range(20):  # the operator's whole allowance is still there, on any signed route
        ts, sig = headers(body=b"", at=NOW + i, method="GET", target="/v1/rl/service")
        assert check(verifier, ts, b"", sig, method="GET", target="/v1/rl/service")
    # The api key's request on the registration route itself lands in the api key's cache too.
    verifier2 = HmacVerifier(API, INS, replay_capacity=5)
    flood_instance_key(verifier2, 5, NOW)
    ts, sig = headers(body=BODY, target="/aigw/v1/register-instance")
    assert check(verifier2, ts, BODY, sig, allow_ins=True, target="/aigw/v1/register-instance")


def test_default_caches_are_per_key_at_the_real_size():
    verifier = HmacVerifier(API, INS)
    assert REPLAY_CAPACITY == 100_000
    assert replay_capacity_by_key(verifier) == {"api": REPLAY_CAPACITY, "instance": REPLAY_CAPACITY}
    results = flood_instance_key(verifier, REPLAY_CAPACITY + 1, NOW)
    assert results[-1] is False and all(results[:-1])
    ts, sig = headers(body=b"", method="GET", target="/v1/rl/service")
    assert check(verifier, ts, b"", sig, method="GET", target="/v1/rl/service")


def test_a_full_cache_logs_at_most_once_a_minute(caplog: pytest.LogCaptureFixture):
    verifier = HmacVerifier(API, INS, replay_capacity=3)
    with caplog.at_level(logging.WARNING, logger="openjiuwen.agent_rl.gateway.hmac"):
        flood_instance_key(verifier, 1000, NOW)
        assert len(caplog.records) == 1 and "instance key full" in caplog.messages[0]
        later = NOW + hmac_auth.FULL_LOG_INTERVAL_MS
        results = []
        for i in range(50):  # the first three entries are live until NOW + SKEW: still full a minute later
            body = b'{"n": %d}' % i
            ts, sig = headers(key=INS, body=body, at=later, target="/r")
            results.append(check(verifier, ts, body, sig, now_ms=later, allow_ins=True, target="/r"))
    assert not any(results)
    assert len(caplog.records) == 2
    assert "refused 1 signed request" in caplog.messages[0]
    assert "refused 997 signed request" in caplog.messages[1]  # the count of the minute, in one line


def test_repr_and_constructor_checks():
    text = repr(HmacVerifier(API, INS, agent_keys=AGENTS))
    assert "aaaa" not in text and "iiii" not in text and "ssss" not in text and "support-bot" in text
    for kwargs in ({"api_key": b""}, {"api_key": API, "ins_key": b""}, {"api_key": API, "skew_ms": 0},
                   {"api_key": API, "replay_capacity": 0}, {"api_key": API, "agent_keys": {"bad id": b"x" * 32}},
                   {"api_key": API, "agent_keys": {"ok": b""}}):
        with pytest.raises(ValueError):
            HmacVerifier(**kwargs)
    with pytest.raises(ValueError):
        RequestSigner(b"")
