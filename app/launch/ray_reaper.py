"""Ends a local Ray with the driver that started it, even a SIGKILLed driver.

``ray.init()`` ties the head's main processes to the driver, but the rest notice their loss
late: Ray's node agents (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) after about a
minute, the actors' workers, and with them the ranks, after several seconds. The driver marks
its local Ray with a token in the environment (:data:`TOKEN_VARIABLE`), which every process of
that Ray inherits and every rank is given; this process watches the driver (its parent) and,
once it is gone, SIGKILLs every process that carries the token. Run as a script
(``python ray_reaper.py DRIVER TOKEN``): it imports nothing of the app. The driver ends it after
its own ``ray.shutdown()``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

TOKEN_VARIABLE = "RLCOMM_LOCAL_RAY"
POLL_S = 0.2


def carriers(token: str) -> list[int]:
    """The processes whose environment holds ``TOKEN_VARIABLE=token``, this one aside."""
    wanted = f"{TOKEN_VARIABLE}={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    if wanted in environ.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:  # gone, or not ours to read
                continue
    return found


def main(driver: int, token: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is the driver's to act on
    while os.getppid() == driver:
        time.sleep(POLL_S)
    for _ in range(3):  # a process started while the first ones were killed
        for pid in carriers(token):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(POLL_S)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
