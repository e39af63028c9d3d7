"""Progress bars: tqdm on a terminal (it comes with transformers/huggingface-hub), plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any


class Bar:
    """A bar of `total` units. On a terminal a tqdm bar; elsewhere (a log, CI) a line at most every 10 s or 25 %."""

    def __init__(self, desc: str, total: int, unit: str = "it") -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.n = 0
        self.postfix = ""
        self.start = time.monotonic()
        self._last_print = self.start
        self._last_share = 0.0
        self._tqdm: Any = None
        if sys.stdout.isatty():
            try:
                from tqdm import tqdm

                self._tqdm = tqdm(total=total, desc=f"{desc:<24}", unit=unit, file=sys.stdout, leave=True,
                                  dynamic_ncols=True, bar_format="{desc} {percentage:3.0f}%|{bar:30}| "
                                  "{n_fmt}/{total_fmt} [{elapsed}]{postfix}")  # tqdm puts ", " first
            except ImportError:
                self._tqdm = None
        if self._tqdm is None:
            print(f"{desc} ...", flush=True)

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        self.n += n
        if postfix is not None:
            self.postfix = postfix
        if self._tqdm is not None:
            if postfix is not None:
                self._tqdm.set_postfix_str(postfix, refresh=False)
            self._tqdm.update(n)
            return
        share = self.n / self.total if self.total else 1.0
        now = time.monotonic()
        if share - self._last_share >= 0.25 or now - self._last_print >= 10 or (self.n >= self.total and n):
            self._last_share, self._last_print = share, now
            self._line()

    def note(self, postfix: str) -> None:
        """Change the text after the bar (e.g. a stage or an elapsed time) without progress."""
        self.postfix = postfix
        if self._tqdm is not None:
            self._tqdm.set_postfix_str(postfix)
        elif time.monotonic() - self._last_print >= 10:
            self._last_print = time.monotonic()
            self._line()

    def _line(self) -> None:
        elapsed = time.monotonic() - self.start
        print(f"  {self.desc}: {self.n}/{self.total} {self.unit} [{elapsed:.0f} s] {self.postfix}".rstrip(),
              flush=True)

    def close(self, summary: str | None = None) -> None:
        if summary is not None:
            self.postfix = summary
        if self._tqdm is not None:
            if summary is not None:
                self._tqdm.set_postfix_str(summary, refresh=False)
            self._tqdm.close()
            self._tqdm = None
        else:
            elapsed = time.monotonic() - self.start
            print(f"  {self.desc}: done in {elapsed:.1f} s {self.postfix}".rstrip(), flush=True)

    def write(self, text: str) -> None:
        """Print a line without breaking the bar."""
        if self._tqdm is not None:
            self._tqdm.write(text, file=sys.stdout)
        else:
            print(text, flush=True)
