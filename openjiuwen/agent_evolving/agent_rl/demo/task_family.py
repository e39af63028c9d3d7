"""The demo's task family, "answer in plain words", and its verifiable reward.

A Task is a short conversation: the user asks one of `PROMPTS`, the model answers, the user says `FOLLOW_UP`, the
model answers again. The reward is computed from the text the agent sees, the way a real agent's verifier would
check an answer: the share of the answers' characters that are plain-word characters (ASCII letters and the space).

Why a tiny random model learns it within a few Training Runs: the tiny model's byte-level BPE vocabulary (384 ids)
holds 162 tokens made only of letters and spaces (the 52 letters and merges such as " the", "in", "ou") and 222 that
are not (digits, punctuation, control bytes, and 128 lone non-ASCII bytes that decode to U+FFFD). A random model
samples them almost uniformly, so about half of an answer's characters are word characters and the reward varies
from Task to Task; the policy only has to shift probability mass from one fixed set of output tokens to another,
which is what PPO on terminal rewards does in a few steps. The prompt carries no information the model could use
(it is random), so what is learned is a property of the output distribution, visible in the text.

Short answers cannot score by saying little: the denominator is at least `MIN_CHARS_PER_ANSWER` per answer, so an
empty or one-letter answer earns little.
"""

from __future__ import annotations

import string
from collections.abc import Sequence

WORD_CHARS = frozenset(string.ascii_letters + " ")
MIN_CHARS_PER_ANSWER = 12

PROMPTS = (
    "Describe the weather today in plain words.",
    "Tell me about your favourite book.",
    "What should I cook for dinner?",
    "Explain what a river is.",
    "Give me advice for a job interview.",
    "Describe a quiet morning in the park.",
    "What is a good name for a cat?",
    "Tell me a short story about a fox.",
    "How do I plan a trip to the sea?",
    "Say something kind to a friend.",
    "Describe the sound of rain.",
    "What makes a good team?",
    "Explain why the sky looks blue.",
    "Tell me about the city you like most.",
    "How should I start learning music?",
    "Describe your ideal weekend.",
)
FOLLOW_UP = "Please go on, in plain words."


def word_char_share(answers: Sequence[str]) -> float:
    """The reward of one Task: word characters / max(all characters, MIN_CHARS_PER_ANSWER × answers), in [0, 1]."""
    text = "".join(answers)
    floor = MIN_CHARS_PER_ANSWER * max(1, len(answers))
    return sum(1 for c in text if c in WORD_CHARS) / max(len(text), floor)


def other_char_share(answers: Sequence[str]) -> float:
    """The opposite objective (`--lineages 2`): characters that are NOT plain-word characters (digits, punctuation,
    other bytes) / the same floored length, in [0, 1]. Also unreachable by saying little."""
    text = "".join(answers)
    floor = MIN_CHARS_PER_ANSWER * max(1, len(answers))
    return sum(1 for c in text if c not in WORD_CHARS) / max(len(text), floor)
