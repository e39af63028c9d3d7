"""HMAC-signed control (CONTRACT §3.2): signature versions, skew window, per-key replay caches, the instance key. The
clock is injected."""

from __future__ import annotations

import hashlib
import hmac
import logging

import pytest

from openjiuwen.agent_evolving.agent_rl.gateway import hmac_auth
from openjiuwen.agent_evolving.agent_rl.gateway.hmac_auth import REPLAY_CAPACITY, HmacVerifier
from openjiuwen.agent_evolving.agent_rl.common.hmac_signing import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    VERSION_HEADER,
    RequestSigner,
    sign,
    sign_request,
)

API = b"a" * 32
INS = b"i" * 32
NOW = 1_735_787_045_123  # 2025-01-02T03:04:05.123Z in ms
SKEW = 300_000
BODY = b'{"reward_mode": "terminal"}'
METHOD, TARGET = "POST", "/v1/rl/tasks/start"


def headers(key: bytes = API, body: bytes = BODY, at: int = NOW, method: str = METHOD,
            target: str = TARGET) -> tuple[str, str]:
    h = sign_request(key, method, target, body, now_ms=at)
    return h[TIMESTAMP_HEADER], h[SIGNATURE_HEADER]


def check(verifier: HmacVerifier, ts: str | None, body: bytes, sig: str | None, *, now_ms: int = NOW,
          allow_ins: bool = False, method: str = METHOD, target: str = TARGET) -> bool:
    return verifier.verify(ts, body, sig, now_ms=now_ms, allow_ins=allow_ins, method=method, target=target,
                           version="2")


# ---------------------------------------------------------------------------------------------- formats


def test_sign_request_matches_the_version_2_formula():
    h = sign_request(API, "post", "/v1/rl/tasks?limit=5", BODY, now_ms=NOW)
    assert set(h) == {"X-Timestamp", "X-Signature", "X-Signature-Version"}
    assert (h["X-Timestamp"], h["X-Signature-Version"]) == (str(NOW), "2")
    message = b"OJRL-HMAC-V2\nPOST\n/v1/rl/tasks?limit=5\n" + str(NOW).encode() + b"\n" + BODY
    assert h["X-Signature"] == hmac.new(API, message, hashlib.sha256).hexdigest()


def test_sign_matches_the_aigw_formula():
    h = sign(API, BODY, now_ms=NOW)
    assert set(h) == {"X-Timestamp", "X-Signature"}
    assert h["X-Timestamp"] == str(NOW)
    assert h["X-Signature"] == hmac.new(API, str(NOW).encode() + BODY, hashlib.sha256).hexdigest()
    assert h["X-Signature"] == h["X-Signature"].lower() and len(h["X-Signature"]) == 64


def test_good_signature():
    ts, sig = headers()
    assert check(HmacVerifier(API), ts, BODY, sig)


def test_version_2_binds_method_path_and_query():
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
    # Version 2 works on both; an AIGW signature presented as version 2 (or the reverse) does not match.
    ts, sig = headers(at=NOW + 1)
    assert check(legacy, ts, BODY, sig)
    assert not legacy.verify(ts, BODY, sig, now_ms=NOW, version=None)
    h2 = sign(API, BODY, now_ms=NOW + 2)
    assert not check(legacy, h2[TIMESTAMP_HEADER], BODY, h2[SIGNATURE_HEADER])


@pytest.mark.parametrize("version", ["3", "", "02", "2 ", "v2"])
def test_unknown_versions_refused(version: str):
    ts, sig = headers()
    verifier = HmacVerifier(API, accept_legacy=True)
    assert not verifier.verify(ts, BODY, sig, now_ms=NOW, method=METHOD, target=TARGET, version=version)


def test_version_2_needs_a_method_and_a_printable_target():
    ts, sig = headers()
    verifier = HmacVerifier(API)
    assert not verifier.verify(ts, BODY, sig, now_ms=NOW, version="2")  # no method, no target
    assert not verifier.verify(ts, BODY, sig, now_ms=NOW, version="2", method="POST\nX", target=TARGET)
    assert not verifier.verify(ts, BODY, sig, now_ms=NOW, version="2", method=METHOD, target="/é")


def test_verify_request_reads_the_headers_case_insensitively():
    import httpx

    request = httpx.Request("GET", "http://gw/v1/rl/tasks", params={"status": "active", "limit": 5})
    RequestSigner(API).sign_httpx(request)
    assert request.headers[VERSION_HEADER] == "2"
    assert HmacVerifier(API).verify_request("GET", request.url.raw_path, request.headers, b"",
                                            now_ms=int(request.headers["x-timestamp"]))


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
    results = [check(verifier, ts, str(i).encode(), sig, now_ms=at) for i, (ts, sig) in enumerate(burst)]
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


# ---------------------------------------------------------------------------------------------- per-key caches


def flood_instance_key(verifier: HmacVerifier, count: int, at: int) -> list[bool]:
    results = []
    for i in range(count):
        body = b'{"name": "junk-%d"}' % i
        ts, sig = headers(key=INS, body=body, at=at, target="/aigw/v1/register-instance")
        results.append(check(verifier, ts, body, sig, now_ms=at, allow_ins=True,
                             target="/aigw/v1/register-instance"))
    return results


def test_instance_key_flood_cannot_refuse_operator_requests():
    """The attack of issue 19 item 3, at a small size: the instance key's cache fills, the api key's does not."""
    verifier = HmacVerifier(API, INS, replay_capacity=20)
    assert flood_instance_key(verifier, 30, NOW) == [True] * 20 + [False] * 10
    assert verifier.replay_entries_by_key == {"api": 0, "instance": 20}
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
    assert verifier.replay_capacity_by_key == {"api": REPLAY_CAPACITY, "instance": REPLAY_CAPACITY}
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
    assert "aaaa" not in repr(HmacVerifier(API, INS)) and "iiii" not in repr(HmacVerifier(API, INS))
    for kwargs in ({"api_key": b""}, {"api_key": API, "ins_key": b""}, {"api_key": API, "skew_ms": 0},
                   {"api_key": API, "replay_capacity": 0}):
        with pytest.raises(ValueError):
            HmacVerifier(**kwargs)
    with pytest.raises(ValueError):
        RequestSigner(b"")
