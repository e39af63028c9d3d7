"""HMAC-signed control (CONTRACT §3.2): signature, skew window, replay cache, the instance key. The clock is injected."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from openjiuwen.agent_evolving.agent_rl.gateway.hmac_auth import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    HmacVerifier,
    sign,
)

API = b"a" * 32
INS = b"i" * 32
NOW = 1_735_787_045_123  # 2025-01-02T03:04:05.123Z in ms
SKEW = 300_000
BODY = b'{"reward_mode": "terminal"}'


def headers(key: bytes = API, body: bytes = BODY, at: int = NOW) -> tuple[str, str]:
    h = sign(key, body, now_ms=at)
    return h[TIMESTAMP_HEADER], h[SIGNATURE_HEADER]


def test_sign_matches_the_contract_formula():
    h = sign(API, BODY, now_ms=NOW)
    assert set(h) == {"X-Timestamp", "X-Signature"}
    assert h["X-Timestamp"] == str(NOW)
    assert h["X-Signature"] == hmac.new(API, str(NOW).encode() + BODY, hashlib.sha256).hexdigest()
    assert h["X-Signature"] == h["X-Signature"].lower() and len(h["X-Signature"]) == 64


def test_good_signature():
    ts, sig = headers()
    assert HmacVerifier(API).verify(ts, BODY, sig, now_ms=NOW)


def test_empty_body_for_bodiless_requests():
    ts, sig = headers(body=b"")
    verifier = HmacVerifier(API)
    assert not verifier.verify(ts, b"{}", sig, now_ms=NOW)  # the body is part of the signature
    assert verifier.verify(ts, b"", sig, now_ms=NOW)


def test_forged_and_wrong_key():
    verifier = HmacVerifier(API, INS)
    ts, sig = headers()
    assert not verifier.verify(ts, BODY + b" ", sig, now_ms=NOW)  # body changed
    assert not verifier.verify(str(NOW + 1), BODY, sig, now_ms=NOW)  # timestamp changed
    flipped = ("0" if sig[0] != "0" else "1") + sig[1:]
    assert not verifier.verify(ts, BODY, flipped, now_ms=NOW)
    ts_b, sig_b = headers(key=b"b" * 32)
    assert not verifier.verify(ts_b, BODY, sig_b, now_ms=NOW)
    assert verifier.replay_entries == 0  # nothing unauthenticated is remembered


def test_uppercase_or_malformed_signature_refused():
    verifier = HmacVerifier(API)
    ts, sig = headers()
    for bad in (sig.upper(), sig[:-1], sig + "0", "", " " + sig[1:], "g" * 64):
        assert not verifier.verify(ts, BODY, bad, now_ms=NOW)
    assert verifier.verify(ts, BODY, sig, now_ms=NOW)


@pytest.mark.parametrize("offset", [SKEW + 1, -(SKEW + 1), 3_600_000, -3_600_000])
def test_stale_and_future_timestamps(offset: int):
    at = NOW + offset
    ts, sig = headers(at=at)
    assert not HmacVerifier(API).verify(ts, BODY, sig, now_ms=NOW)


@pytest.mark.parametrize("offset", [SKEW, -SKEW, 0])
def test_edges_of_the_window_accepted(offset: int):
    ts, sig = headers(at=NOW + offset)
    assert HmacVerifier(API).verify(ts, BODY, sig, now_ms=NOW)


@pytest.mark.parametrize("ts", ["", "-1735787045123", "+1735787045123", "1735787045123.0", "1.7e12", " 1735787045123",
                                "1735787045123 ", "0x1", "١٧٣٥٧٨٧٠٤٥١٢٣", "１７３５７８７０４５１２３", "9" * 40])
def test_non_digit_timestamps(ts: str):
    sig = hmac.new(API, ts.encode() + BODY, hashlib.sha256).hexdigest()
    assert not HmacVerifier(API).verify(ts, BODY, sig, now_ms=NOW)


def test_missing_headers():
    ts, sig = headers()
    verifier = HmacVerifier(API)
    assert not verifier.verify(None, BODY, sig, now_ms=NOW)
    assert not verifier.verify(ts, BODY, None, now_ms=NOW)
    assert not verifier.verify(None, BODY, None, now_ms=NOW)


def test_replay_rejected():
    verifier = HmacVerifier(API)
    ts, sig = headers()
    assert verifier.verify(ts, BODY, sig, now_ms=NOW)
    assert not verifier.verify(ts, BODY, sig, now_ms=NOW)
    # Another request in the same millisecond has another body, hence another signature: accepted.
    other = b'{"reward_mode": "delayed_feedback"}'
    ts2, sig2 = headers(body=other)
    assert verifier.verify(ts2, other, sig2, now_ms=NOW + 1)
    assert verifier.replay_entries == 2
    assert not verifier.verify(ts, BODY, sig, now_ms=NOW + SKEW)  # still inside the window
    # Past the window the pairs are forgotten, and the timestamp is stale anyway.
    assert not verifier.verify(ts, BODY, sig, now_ms=NOW + SKEW + 1)
    assert verifier.replay_entries == 0


def test_clock_stepping_back_does_not_reopen_evicted_replays():
    verifier = HmacVerifier(API)
    ts, sig = headers()
    assert verifier.verify(ts, BODY, sig, now_ms=NOW)
    later_ts, later_sig = headers(at=NOW + SKEW + 10)
    assert verifier.verify(later_ts, BODY, later_sig, now_ms=NOW + SKEW + 10)  # evicts the first pair
    assert not verifier.verify(ts, BODY, sig, now_ms=NOW)  # the clock went back: still refused


def test_cache_stays_bounded():
    verifier = HmacVerifier(API, replay_capacity=50)
    # A steady stream over 20 windows: expired entries leave as fast as new ones arrive.
    step = SKEW // 10
    for i in range(200):
        at = NOW + i * step
        ts, sig = headers(at=at)
        assert verifier.verify(ts, BODY, sig, now_ms=at)
        assert verifier.replay_entries <= 11
    # A burst inside one window beyond the capacity is refused (fail closed), never grows the cache.
    burst = [headers(body=str(i).encode(), at=NOW + 200 * step) for i in range(60)]
    results = [verifier.verify(ts, str(i).encode(), sig, now_ms=NOW + 200 * step) for i, (ts, sig) in enumerate(burst)]
    # 10 pairs of the last window are still live, so 40 more fit.
    assert results == [True] * 40 + [False] * 20
    assert verifier.replay_entries == 50
    # Once the window has passed, the cache drains and requests pass again.
    later = NOW + 200 * step + SKEW + 1
    ts, sig = headers(at=later)
    assert verifier.verify(ts, BODY, sig, now_ms=later)
    assert verifier.replay_entries == 1


def test_instance_key_only_with_allow_ins():
    verifier = HmacVerifier(API, INS)
    ts, sig = headers(key=INS)
    assert not verifier.verify(ts, BODY, sig, now_ms=NOW)
    assert verifier.verify(ts, BODY, sig, now_ms=NOW, allow_ins=True)
    ts, sig = headers(key=API, at=NOW + 1)
    assert verifier.verify(ts, BODY, sig, now_ms=NOW, allow_ins=True)  # the api key works there too
    ts, sig = headers(key=INS, at=NOW + 2)
    assert not HmacVerifier(API).verify(ts, BODY, sig, now_ms=NOW, allow_ins=True)  # no instance key configured


def test_repr_and_constructor_checks():
    assert "aaaa" not in repr(HmacVerifier(API, INS)) and "iiii" not in repr(HmacVerifier(API, INS))
    for kwargs in ({"api_key": b""}, {"api_key": API, "ins_key": b""}, {"api_key": API, "skew_ms": 0},
                   {"api_key": API, "replay_capacity": 0}):
        with pytest.raises(ValueError):
            HmacVerifier(**kwargs)
