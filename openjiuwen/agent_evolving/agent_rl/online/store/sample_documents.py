"""Whole sample documents (CONTRACT §4.5): what a Training Run trains on and what the detail route shows, with the
prompt put together again from its shared blocks (store/prompt_blocks.py) and the reward breakdown of its line."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
from redis.asyncio import Redis

from ...common.ids import InvalidIdentifier
from . import keys, prompt_blocks
from .codec import PackedSample, decode_meta, text
from .hash_reads import hmget_many
from .reward_view import breakdown
from .sample_line import SampleLine
from .sample_status import SampleStatus

# The `exclusion` shown for an `excluded` sample stored without one: its instance was excluded (issue 28 item 2).
INSTANCE_EXCLUSION = {"reason": "instance"}
_DOC_FIELDS = (
    "sample_json", "prompt_ids", "response_ids", "response_logprobs", "rewards", "prompt_blocks", "status",
)
_BLOCK_READ_ATTEMPTS = 3  # a block vanishes under a reader only when its sample was deleted meanwhile


class SampleDocuments:
    """Reads the samples of one model's lines (`line`: the default line, whose reward policy `get_documents`
    follows; `detail` follows the sample's own line's)."""

    def __init__(self, redis: Redis, line: SampleLine) -> None:
        self._redis = redis
        self._line = line

    async def get_documents(self, sample_ids: Sequence[str]) -> list[dict[str, Any]]:
        """Logical documents (§4.5, arrays unpacked) of the samples that exist, in input order."""
        rows = await self._doc_rows([keys.traj(sample_id) for sample_id in sample_ids])
        return [_document(self._line, row) for row in rows if row[-1] is not None]

    async def _doc_rows(self, hash_keys: Sequence[str]) -> list[list[bytes | None]]:
        """`_DOC_FIELDS` of each hash with `prompt_ids` holding the whole prompt again (shared blocks + tail).

        Invariant P guarantees the blocks of a sample that exists; a block missing here means its sample was
        deleted between the two reads, so that sample is read again (and is then gone, or complete)."""
        rows = await hmget_many(self._redis, hash_keys, _DOC_FIELDS)
        todo = list(range(len(rows)))
        for attempt in range(_BLOCK_READ_ATTEMPTS):
            wanted = {i: prompt_blocks.unpack_digests(rows[i][5]) for i in todo if rows[i][-1] is not None}
            found = await prompt_blocks.read_blocks(self._redis, (d for ds in wanted.values() for d in ds))
            todo = []
            for i, digests in wanted.items():
                parts = [found[d] for d in digests]
                if any(part is None for part in parts):
                    todo.append(i)
                    continue
                rows[i] = [rows[i][0], b"".join([*(p or b"" for p in parts), rows[i][1] or b""]), *rows[i][2:]]
            if not todo:
                return rows
            if attempt + 1 < _BLOCK_READ_ATTEMPTS:
                for i, row in zip(todo, await hmget_many(self._redis, [hash_keys[i] for i in todo], _DOC_FIELDS)):
                    rows[i] = row
        raise RuntimeError(f"prompt blocks of {len(todo)} sample(s) stay missing (invariant P broken)")

    async def detail(self, sample_id: str) -> dict[str, Any] | None:
        """The full view of §4.5 (what the detail route returns), or None when the id is unknown or malformed."""
        try:
            key = keys.traj(sample_id)
        except InvalidIdentifier:
            return None
        row = (await self._doc_rows([key]))[0]
        status = text(row[-1])
        if status is None:
            return None
        # The breakdown follows the policy of the sample's own lineage (`reward_policy.lineages`).
        doc = _document(self._line.for_lineage(text(await self._redis.hget(key, "lineage"))), row)
        trajectory = doc["trajectory"]
        prompt, response_ids = trajectory["prompt_ids"], trajectory["response_ids"]
        logprobs = trajectory["response_logprobs"]
        response_mask = trajectory.get("response_mask") or [1] * len(response_ids)
        trajectory["input_ids"] = prompt + response_ids
        trajectory["attention_mask"] = [1] * (len(prompt) + len(response_ids))
        trajectory["response_mask"] = [0] * len(prompt) + list(response_mask)
        trajectory["prompt_text"] = ""
        response = dict(doc.get("response") or {})
        response["prompt_token_ids"] = prompt
        choices = [dict(c) if isinstance(c, dict) else c for c in response.get("choices") or [{}]]
        if isinstance(choices[0], dict):
            choices[0]["token_ids"] = response_ids
            choices[0]["logprobs"] = {"content": [{"logprob": x} for x in logprobs]}
        response["choices"] = choices
        doc["response"] = response
        doc["trajectory_id"] = doc.get("trajectory_id") or sample_id
        doc.setdefault("instance", None)  # the serving instance, when the gateway said (ext)
        if status == SampleStatus.EXCLUDED:
            doc.setdefault("exclusion", INSTANCE_EXCLUSION)  # a constraint's exclusion is in the document itself
        doc["status"] = status
        doc["_store_status"] = status
        return doc


def _document(line: SampleLine, row: list[bytes | None]) -> dict[str, Any]:
    """The logical document; under `line`'s reward policy `judge.score` is the aggregated score and `rewards` the
    per-source breakdown (the trainer reads `judge.score`)."""
    doc = _packed(row).to_document()
    raw_rewards = row[4]
    if raw_rewards:
        state = orjson.loads(raw_rewards)
        policy = line.reward_policy
        # Without a policy (it was removed from the config) the recorded breakdown is still shown.
        doc["rewards"] = policy.view(state) if policy is not None else breakdown(state, "weighted_mean")
        if state.get("score") is not None and isinstance(doc.get("judge"), dict):
            doc["judge"] = {**doc["judge"], "score": state["score"]}
    return doc


def _packed(row: list[bytes | None]) -> PackedSample:
    """From a `_doc_rows` row (its `prompt_ids` already the whole prompt)."""
    sample_json, prompt, response, logprobs = row[0], row[1], row[2], row[3]
    return PackedSample(decode_meta(sample_json), prompt or b"", response or b"", logprobs or b"")
