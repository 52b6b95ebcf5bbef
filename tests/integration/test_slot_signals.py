"""A slot waits for signals (app/launch/slots.py: ``next_signal``) and forwards what it gets to
its rank. Stopped and continued while it waits (Ctrl-Z then ``fg``, or SIGSTOP and SIGCONT),
it must see no signal that nobody sent: a blocking ``sigtimedwait`` interrupted past its deadline
returned an unfilled siginfo (SIGHUP, SIGINT: garbage), and the slot forwarded SIGINT to its
rank, which ended the run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.apprun import REPO

pytestmark = pytest.mark.integration

WAITER = """
import signal, time
from app.launch.slots import next_signal
WANTED = frozenset({signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1})
signal.pthread_sigmask(signal.SIG_BLOCK, WANTED)
print("ready", flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    info = next_signal(WANTED, 0.2)
    if info is not None:
        print(info.si_signo, flush=True)
        if info.si_signo == signal.SIGTERM:
            break
"""


def test_a_stopped_and_continued_wait_sees_only_the_signals_sent() -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    waiter = subprocess.Popen([sys.executable, "-c", WAITER], stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        assert waiter.stdout is not None and waiter.stdout.readline().strip() == "ready"
        for _ in range(5):  # each stop outlasts the wait's 0.2 s
            waiter.send_signal(signal.SIGSTOP)
            time.sleep(0.35)
            waiter.send_signal(signal.SIGCONT)
            time.sleep(0.15)
        waiter.send_signal(signal.SIGUSR1)
        time.sleep(0.15)
        waiter.send_signal(signal.SIGTERM)
        out, _ = waiter.communicate(timeout=60)
    finally:
        waiter.kill()
        waiter.wait(10)
    assert out.split() == [str(int(signal.SIGUSR1)), str(int(signal.SIGTERM))]
    assert waiter.returncode == 0
