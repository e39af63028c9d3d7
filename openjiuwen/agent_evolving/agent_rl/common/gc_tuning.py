"""Garbage-collector settings for the two server processes (gateway, RL Service).

A large capture (2,048 + 2,048 tokens) parses into ~20k containers; with CPython's default gen-0 threshold (700)
that is ~30 collections per parse, and the resulting gen-2 passes walk every live object of every concurrent
request: measured at 64 sessions, 60-65 % of the gateway's CPU went to the collector. The parsed JSON trees are
acyclic and freed by reference counting, so collecting less often loses nothing but a little latency in reclaiming
real cycles (rare here: exceptions with tracebacks).
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 50_000  # net container allocations between gen-0 passes (CPython default: 700)
GEN1_THRESHOLD = 20  # gen-0 passes per gen-1 pass (default 10)
GEN2_THRESHOLD = 10  # gen-1 passes per gen-2 pass (default 10)


def tune_gc() -> None:
    """Call once, after imports and app construction: `gc.freeze()` moves the start-up objects (modules, classes,
    the app) to the permanent generation, so no later pass walks them."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, GEN1_THRESHOLD, GEN2_THRESHOLD)
