"""Prompt-block splitting and chained digests (store/prompt_blocks.py)."""

from __future__ import annotations

import random

import pytest

from openjiuwen.agent_evolving.agent_rl.common.ids import InvalidIdentifier
from openjiuwen.agent_evolving.agent_rl.online.store import keys
from openjiuwen.agent_evolving.agent_rl.online.store.codec import pack_ids, unpack_ids
from openjiuwen.agent_evolving.agent_rl.online.store.prompt_blocks import (
    BLOCK_BYTES,
    BLOCK_IDS,
    DIGEST_BYTES,
    block_key,
    pack_digests,
    release_counts,
    split_prompt,
    unpack_digests,
    verify_chain,
)

rng = random.Random(8)


def ids(n: int) -> list[int]:
    return [rng.randrange(2**32) for _ in range(n)]


@pytest.mark.parametrize(
    ("length", "blocks", "tail"),
    [(0, 0, 0), (1, 0, 1), (BLOCK_IDS - 1, 0, BLOCK_IDS - 1), (BLOCK_IDS, 1, 0), (2 * BLOCK_IDS + 5, 2, 5)],
)
def test_split_at_fixed_boundaries_and_rejoin_exactly(length: int, blocks: int, tail: int) -> None:
    prompt = ids(length)
    split, rest = split_prompt(pack_ids(prompt))
    assert len(split) == blocks and len(rest) == 4 * tail
    assert all(len(block) == BLOCK_BYTES and len(digest) == DIGEST_BYTES for digest, block in split)
    assert unpack_ids(b"".join(block for _, block in split) + rest) == prompt
    assert verify_chain([d for d, _ in split], [b for _, b in split])


def test_a_longer_turn_reuses_every_full_block_of_the_earlier_prompt() -> None:
    first = ids(3 * BLOCK_IDS + 40)
    later = first + ids(700)  # the completion and a new user message appended
    a, _ = split_prompt(pack_ids(first))
    b, _ = split_prompt(pack_ids(later))
    assert [d for d, _ in b[: len(a)]] == [d for d, _ in a]
    assert len(b) == len(later) // BLOCK_IDS


def test_digests_name_the_whole_prefix_not_the_block_alone() -> None:
    shared_block = ids(BLOCK_IDS)
    x, _ = split_prompt(pack_ids(ids(BLOCK_IDS) + shared_block))
    y, _ = split_prompt(pack_ids(ids(BLOCK_IDS) + shared_block))
    assert x[1][1] == y[1][1]  # same ids at the same position ...
    assert x[1][0] != y[1][0]  # ... behind different prefixes: different blocks
    # and a change in the first block changes every later digest
    base = ids(3 * BLOCK_IDS)
    changed = [base[0] ^ 1, *base[1:]]
    p, _ = split_prompt(pack_ids(base))
    q, _ = split_prompt(pack_ids(changed))
    assert all(dp != dq for (dp, _), (dq, _) in zip(p, q))


def test_verify_chain_refuses_swapped_or_altered_contents() -> None:
    split, _ = split_prompt(pack_ids(ids(2 * BLOCK_IDS)))
    digests, blocks = [d for d, _ in split], [b for _, b in split]
    assert not verify_chain(digests, blocks[::-1])
    assert not verify_chain(digests, [blocks[0], b"\x00" * BLOCK_BYTES])
    assert not verify_chain(digests, [blocks[0], blocks[1][:-4]])


def test_digest_field_round_trip_and_refusal() -> None:
    split, _ = split_prompt(pack_ids(ids(3 * BLOCK_IDS)))
    digests = [d for d, _ in split]
    assert unpack_digests(pack_digests(digests)) == digests
    assert unpack_digests(None) == [] and unpack_digests(b"") == []
    with pytest.raises(ValueError):
        unpack_digests(b"\x00" * (DIGEST_BYTES + 1))
    assert release_counts([pack_digests(digests), pack_digests(digests[:1]), None]) == {
        digests[0]: 2, digests[1]: 1, digests[2]: 1}


def test_block_keys_are_validated() -> None:
    digest = split_prompt(pack_ids(ids(BLOCK_IDS)))[0][0][0]
    assert block_key(digest) == f"rl:v1:prompt_block:{digest.hex()}"
    for bad in ("", "ab", "G" * 32, digest.hex().upper(), digest.hex() + "0", "../" + "a" * 29):
        with pytest.raises(InvalidIdentifier):
            keys.prompt_block(bad)
