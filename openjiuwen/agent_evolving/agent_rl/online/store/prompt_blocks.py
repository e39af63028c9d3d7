"""Prompt-prefix sharing: a published sample's prompt ids as content-addressed blocks plus a tail.

A multi-turn conversation sends each turn the whole conversation so far, so most prompt ids repeat an earlier
turn's prompt. A sample's packed prompt is cut at fixed boundaries (every `BLOCK_IDS` ids, counted from the start);
each full block is stored once in `rl:v1:prompt_block:{digest}` and the sample keeps only the list of its block
digests (`prompt_blocks`, 16 raw bytes each) and the ids after the last full block (`prompt_ids`, the tail). A
block's digest chains its parent's, as in a paged KV cache: digest_i = BLAKE2b-128(digest_{i-1} || block_i bytes),
so equal digests mean equal prefixes, never only equal blocks at the same position.

Block key: HASH {`ids`: packed uint32 LE, exactly BLOCK_IDS ids; `refs`: number of referencing samples}.
Invariant (P): a block exists iff some sample hash references it, and `refs` = the number of sample hashes whose
`prompt_blocks` name it. Sample hashes never carry a TTL (they are deleted explicitly: roll-back, retention sweep,
reward-policy drop), so every reference change happens in the MULTI that inserts or deletes the sample:
`queue_acquire` and `queue_release` are only ever queued inside such a MULTI. Blocks never carry a TTL either.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline

from . import keys

# 254 ids = 1016 bytes: with the sds header and NUL the value fits jemalloc's 1024-byte class (256 ids would take
# 1280). Smaller blocks share more (the tail, stored per sample, averages half a block); each costs ~270 B of keys.
BLOCK_IDS = 254
BLOCK_BYTES = 4 * BLOCK_IDS
DIGEST_BYTES = 16
_ROOT = b"rl:v1:prompt"  # parent of the first block

# Inside the caller's MULTI (EVAL, not EVALSHA: a NOSCRIPT error inside EXEC would not undo the rest). Drops
# ARGV[i] references of KEYS[i] and deletes a block nobody references any more (invariant P).
_RELEASE = """
for i, key in ipairs(KEYS) do
  if redis.call('HINCRBY', key, 'refs', -tonumber(ARGV[i])) <= 0 then
    redis.call('DEL', key)
  end
end
return #KEYS
"""


def chain_digest(parent: bytes, block: bytes) -> bytes:
    return hashlib.blake2b(parent + block, digest_size=DIGEST_BYTES).digest()


def split_prompt(prompt: bytes) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """((digest, block bytes) of each full block in order, tail bytes) of a packed prompt."""
    full = len(prompt) - len(prompt) % BLOCK_BYTES
    blocks = []
    parent = _ROOT
    for pos in range(0, full, BLOCK_BYTES):
        block = prompt[pos : pos + BLOCK_BYTES]
        parent = chain_digest(parent, block)
        blocks.append((parent, block))
    return blocks, prompt[full:]


def verify_chain(digests: Sequence[bytes], blocks: Sequence[bytes]) -> bool:
    """Whether `blocks` are the contents the chained `digests` name (the invariant checker's content check)."""
    parent = _ROOT
    for digest, block in zip(digests, blocks, strict=True):
        if len(block) != BLOCK_BYTES or chain_digest(parent, block) != digest:
            return False
        parent = digest
    return True


def pack_digests(digests: Iterable[bytes]) -> bytes:
    return b"".join(digests)


def unpack_digests(field: bytes | None) -> list[bytes]:
    """The block digests of a sample's `prompt_blocks` field; none for samples stored before prefix sharing."""
    if not field:
        return []
    if len(field) % DIGEST_BYTES:
        raise ValueError("prompt_blocks is not a list of 16-byte digests")
    return [field[i : i + DIGEST_BYTES] for i in range(0, len(field), DIGEST_BYTES)]


def block_key(digest: bytes) -> str:
    return keys.prompt_block(digest.hex())


def queue_acquire(pipe: Pipeline, blocks: Mapping[bytes, tuple[bytes, int]]) -> None:
    """Inside the MULTI that inserts the samples: add `count` references to each block (digest -> (bytes, count)),
    writing its ids if it is new (a block deleted by an earlier EXEC is simply written again)."""
    for digest, (block, count) in blocks.items():
        key = block_key(digest)
        pipe.hsetnx(key, "ids", block)
        pipe.hincrby(key, "refs", count)


def queue_release(pipe: Pipeline, counts: Mapping[bytes, int]) -> None:
    """Inside the MULTI that deletes the samples: drop `count` references of each block (digest -> count)."""
    if counts:
        digests = list(counts)
        pipe.eval(_RELEASE, len(digests), *(block_key(d) for d in digests), *(counts[d] for d in digests))


def release_counts(fields: Iterable[bytes | None]) -> Counter[bytes]:
    """References held by the deleted samples, from their `prompt_blocks` fields."""
    counts: Counter[bytes] = Counter()
    for field in fields:
        counts.update(unpack_digests(field))
    return counts


async def read_blocks(redis: Redis, digests: Iterable[bytes]) -> dict[bytes, bytes | None]:
    """The ids of each distinct block, None for a block that is gone (its last sample was deleted meanwhile)."""
    wanted = list(dict.fromkeys(digests))
    if not wanted:
        return {}
    async with redis.pipeline(transaction=False) as pipe:
        for digest in wanted:
            pipe.hget(block_key(digest), "ids")
        values = await pipe.execute()
    return dict(zip(wanted, values))
