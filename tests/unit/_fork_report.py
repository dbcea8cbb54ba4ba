"""A program that writes its process state as JSON (tests/unit/test_fork.py: a forked rank against a fresh
interpreter): `python -u _fork_report.py OUT ARGS...`, run by the interpreter or by a ForkedRank."""

import json
import os
import signal
import sys


def main() -> int:
    import torch

    handlers = {signal.Signals(s).name: repr(signal.getsignal(s)) for s in
                (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGPIPE)}
    state = {
        "argv": sys.argv[2:],
        "env": {k: os.environ.get(k) for k in ("FORK_TEST", "OMP_NUM_THREADS", "LAUNCHER_ONLY")},
        "handlers": handlers,
        "wakeup_fd": signal.set_wakeup_fd(-1),
        "session_leader": os.getsid(0) == os.getpid(),
        "unbuffered": [sys.stdout.write_through, sys.stderr.write_through],
        "threads": torch.get_num_threads(),
        "torch_seed": torch.initial_seed(),
    }
    with open(sys.argv[1], "w") as f:
        json.dump(state, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
