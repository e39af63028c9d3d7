"""`record_dir`: the JSONL copy of the rail-v1 samples the RL Service stored (online/rail_ingest/jsonl_copy.py),
through the real upload route of a real service process with a fake Judge on a socket.

One line per stored sample, equal to its trajectory document; a sample uploaded again is not written twice; the
folder and the file are private; the file rotates within `record_max_bytes` × (`record_backup_count` + 1); a copy
that cannot be written leaves the upload and the stored sample untouched; `record_dir: ""` writes nothing.
"""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.support.fake_judge import FakeJudge
from tests.support.service_process import ServiceProcess

pytestmark = pytest.mark.system

FILE = "rail-samples.jsonl"


def rail_sample(step: int, text: str = "") -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": f"question {step} {text}"}],
        "prompt_ids": [100 + step, 101, 102], "response_tokens": [200 + step, 201], "logprobs": [-0.5, -0.25],
        "response": {"content": f"reply {step}", "finish_reason": "stop"}, "step_index": step,
    }


def upload(client: httpx.Client, session: str, *samples: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/v1/gateway/upload/batch", json={
        "protocol_version": "rail-v1", "session_id": session, "trajectory_id": f"traj-{session}",
        "samples": list(samples), "session_done": True,
    })
    assert r.status_code == 200, r.text
    return r.json()["result"]


def lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


@pytest.fixture(scope="module")
def judge() -> Iterator[FakeJudge]:
    with FakeJudge() as j:
        yield j


def service(tmp: Path, redis_url: str, judge: FakeJudge, **overrides: Any) -> ServiceProcess:
    return ServiceProcess(tmp, redis_url, judge_endpoint=judge.url, judge_model="judge", judge_retries=0,
                          **overrides)


def test_every_stored_rail_sample_is_one_private_jsonl_line(redis, redis_url, judge, tmp_path: Path) -> None:
    records = tmp_path / "records"
    with service(tmp_path, redis_url, judge, record_dir=str(records)) as svc, \
            httpx.Client(base_url=svc.url, timeout=30) as client:
        result = upload(client, "s1", rail_sample(0), rail_sample(1))
        assert (result["accepted"], result["judged"]) == (2, 2)
        copy = records / FILE
        written = lines(copy)
        assert [d["sample_id"] for d in written] == ["traj-s1:0", "traj-s1:1"]
        for doc in written:  # the logical document (the detail view adds derived arrays to it)
            stored = client.get(f"/v1/rl/trajectories/{doc['sample_id']}").json()
            assert {k: stored["trajectory"][k] for k in doc["trajectory"]} == doc["trajectory"]
            assert doc["request"] == stored["request"] and doc["response"]["choices"]
            assert doc["judge"]["score"] == stored["judge"]["score"]
            assert doc["source"] == "rail"
        assert [d["trajectory"]["prompt_ids"] for d in written] == [[100, 101, 102], [101, 101, 102]]
        assert stat.S_IMODE(copy.stat().st_mode) == 0o600
        assert stat.S_IMODE(records.stat().st_mode) == 0o700
        # The same samples again: judged again, but not stored again, so not written again.
        upload(client, "s1", rail_sample(0), rail_sample(1))
        upload(client, "s2", rail_sample(0))
        assert [d["sample_id"] for d in lines(copy)] == ["traj-s1:0", "traj-s1:1", "traj-s2:0"]


def test_the_copy_rotates_within_its_bound(redis, redis_url, judge, tmp_path: Path) -> None:
    records = tmp_path / "records"
    with service(tmp_path, redis_url, judge, record_dir=str(records), record_max_bytes=4096,
                 record_backup_count=2) as svc, httpx.Client(base_url=svc.url, timeout=30) as client:
        for i in range(12):
            upload(client, f"r{i}", rail_sample(0, "x" * 600))
        files = sorted(p.name for p in records.iterdir())
        assert files == [FILE, f"{FILE}.1", f"{FILE}.2"]
        for p in records.iterdir():
            assert p.stat().st_size <= 4096 and stat.S_IMODE(p.stat().st_mode) == 0o600
        # Newest in the live file, older ones shifted; the oldest dropped, never reordered.
        kept = [d["sample_id"] for name in (f"{FILE}.2", f"{FILE}.1", FILE) for d in lines(records / name)]
        assert kept == [f"traj-r{i}:0" for i in range(12 - len(kept), 12)]


def test_a_copy_that_cannot_be_written_fails_nothing(redis, redis_url, judge, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the folder should be")
    with service(tmp_path, redis_url, judge, record_dir=str(blocker / "records")) as svc, \
            httpx.Client(base_url=svc.url, timeout=30) as client:
        result = upload(client, "f1", rail_sample(0))
        assert result["judged"] == 1 and result["errors"] == []
        assert client.get("/v1/rl/trajectories/traj-f1:0").status_code == 200
        assert "rail record copy of 1 sample(s) not written" in svc.log()


def test_an_empty_record_dir_writes_nothing(redis, redis_url, judge, tmp_path: Path) -> None:
    with service(tmp_path / "svc", redis_url, judge, record_dir="") as svc, \
            httpx.Client(base_url=svc.url, timeout=30) as client:
        upload(client, "e1", rail_sample(0))
        assert client.get("/v1/rl/trajectories/traj-e1:0").status_code == 200
    assert not (tmp_path / "svc" / "records").exists() and not list(Path(svc.dir).rglob(FILE))
