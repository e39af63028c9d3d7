"""Parent-death watchdog: the service must not outlive the gateway that started it (CONTRACT §2.1, D20).

It exits at once, skipping graceful shutdown, so it behaves like a crash and startup recovery reconciles.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import threading
import time

log = logging.getLogger("openjiuwen.agent_rl.online.watchdog")

PR_SET_PDEATHSIG = 1
CHECK_INTERVAL_S = 1.0
EXIT_CODE = 70


def _set_pdeathsig() -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False  # not Linux: the getppid() check below still bounds the delay


def install_parent_death_watchdog() -> None:
    parent = os.getppid()
    if parent == 1:
        return  # started by init (e.g. a container entry point): there is no parent to watch
    _set_pdeathsig()
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(EXIT_CODE)

    def watch() -> None:
        while True:
            time.sleep(CHECK_INTERVAL_S)
            if os.getppid() != parent:
                log.error("parent process %d is gone; exiting", parent)
                os._exit(EXIT_CODE)

    threading.Thread(target=watch, name="parent-death-watchdog", daemon=True).start()
