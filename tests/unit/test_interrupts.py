"""megappo.parallel.interrupts in one process (a child Python, so that its handlers and its exit are
its own): the first SIGINT / SIGTERM is only recorded, a repeat within REPEAT_WINDOW_S counts
once, a later one ends the process at once with 128 + the first signal and one line, even
while the main thread is busy. The whole run: tests/e2e/test_interrupts.py."""

import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import os, signal, sys, time
from megappo.parallel import interrupts

interrupts.install(announce=True)
assert interrupts.requested() == 0
os.kill(os.getpid(), signal.SIGTERM)
os.kill(os.getpid(), signal.SIGTERM)  # a second sender's copy: the same request
time.sleep(0.3)
print("requested", interrupts.requested(), flush=True)
time.sleep(interrupts.REPEAT_WINDOW_S + 0.2)
os.kill(os.getpid(), signal.SIGINT)  # a second request: the watcher ends the process
end = time.time() + 10
while time.time() < end:  # busy main thread
    pass
print("still running", flush=True)
"""


def test_first_signal_recorded_repeat_counted_once_second_stops_at_once():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout == "requested 15\n", proc.stdout + proc.stderr
    assert proc.returncode == 143, proc.stdout + proc.stderr  # the first signal's code
    assert proc.stderr.splitlines()[0].startswith("megappo: SIGTERM received: stopping after the step in progress")
    assert proc.stderr.splitlines()[1].startswith("megappo: interrupted again (SIGINT): stopped at once"), proc.stderr
    assert len(proc.stderr.splitlines()) == 2, proc.stderr
    assert "Traceback" not in proc.stderr


def test_uninstall_restores_the_default_handlers():
    script = ("import signal; from megappo.parallel import interrupts; interrupts.install(announce=False); "
              "interrupts.uninstall(); assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL; "
              "assert signal.set_wakeup_fd(-1) == -1; print('ok')")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stdout + proc.stderr


def test_sigint_during_start_up_is_raised_after_the_block():
    """A Ctrl-C while start-up imports C++ extensions is held, then raised in Python code, and the
    handler from before the block is back. Python's default handler is installed for the test: a
    test process started in the background by a non-interactive shell inherits SIGINT ignored."""
    from megappo.parallel import interrupts

    outside = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        reached_end = False
        with pytest.raises(KeyboardInterrupt):
            with interrupts.held_during_start_up():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs here: it must not raise
                reached_end = True
        assert reached_end
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, outside)
