"""megappo.parallel.fork: a rank forked from the launcher starts in the state a fresh `python -u` rank
starts in (argv, environment, signal handlers, session, unbuffered output, torch's threads and
generator), and the launcher's preload of the ranks' modules leaves it able to fork (one thread).
The same metrics from forked and fresh ranks, and the launcher's failure handling with forked ranks,
are end-to-end tests (tests/e2e/test_fork_launch.py, the hygiene tests)."""

import json
import os
import signal
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPORT = os.path.join(REPO, "tests", "unit", "_fork_report.py")

# a launcher with state a fresh rank does not have: handlers, a wakeup fd, more torch threads, a used
# generator, a variable the rank's environment does not hold; it forks one rank, reporting to argv[1]
LAUNCHER = f"""
import os, signal, socket, sys
import torch
from megappo.parallel.fork import ForkedRank
signal.signal(signal.SIGTERM, lambda *a: None)
signal.signal(signal.SIGHUP, lambda *a: None)
signal.signal(signal.SIGINT, lambda *a: None)
a, b = socket.socketpair()
b.setblocking(False)
signal.set_wakeup_fd(b.fileno())
torch.set_num_threads(2)
torch.rand(5)
print(torch.initial_seed(), flush=True)
os.environ["LAUNCHER_ONLY"] = "1"
env = {{k: v for k, v in os.environ.items() if k != "LAUNCHER_ONLY"}}
env.update(FORK_TEST="rank", OMP_NUM_THREADS="1")
rank = ForkedRank((sys.executable, "-u", {REPORT!r}, sys.argv[1], "x", "--y=1"), env, ({REPORT!r},), 0)
sys.exit(rank.wait())
"""


def test_a_forked_rank_starts_as_a_fresh_interpreter(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    forked, fresh = tmp_path / "forked.json", tmp_path / "fresh.json"
    launcher = subprocess.run([sys.executable, "-c", LAUNCHER, str(forked)], env=env, check=True, timeout=300,
                              capture_output=True, text=True)
    # the fresh rank as torchrun starts it from a launcher that handles SIGINT (megappo's does): a handled
    # signal is default again after exec (pytest-xdist's workers ignore SIGINT, which a child would inherit)
    subprocess.run([sys.executable, "-u", REPORT, str(fresh), "x", "--y=1"], check=True, timeout=300,
                   env=dict(env, FORK_TEST="rank", OMP_NUM_THREADS="1"), start_new_session=True,
                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    got, want = json.loads(forked.read_text()), json.loads(fresh.read_text())
    assert got.pop("torch_seed") != int(launcher.stdout)  # a seed of its own, as a fresh process draws
    want.pop("torch_seed")
    assert got == want
    assert want["argv"] == ["x", "--y=1"] and want["env"]["FORK_TEST"] == "rank" and want["threads"] == 1


def test_a_failing_forked_rank_exits_as_the_interpreter_would(tmp_path):
    (tmp_path / "bug.py").write_text("raise ValueError('a bug')\n")
    (tmp_path / "refuse.py").write_text("raise SystemExit('refused')\n")
    (tmp_path / "two.py").write_text("import sys\nsys.exit(2)\n")
    script = f"""
import sys
from megappo.parallel.fork import ForkedRank
codes = [ForkedRank((sys.executable, "-u", str(f)), {{}}, (str(f),), 0).wait()
         for f in ({str(tmp_path / "bug.py")!r}, {str(tmp_path / "refuse.py")!r}, {str(tmp_path / "two.py")!r})]
print(codes)
"""
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=300)
    assert proc.stdout.strip() == "[1, 1, 2]", proc.stderr
    assert "ValueError: a bug" in proc.stderr and "Traceback" in proc.stderr and "refused" in proc.stderr
    assert "fork.py" not in proc.stderr and "runpy" not in proc.stderr  # the script's own frames, as python shows them


def test_a_forked_rank_ends_with_a_thread_pool_left_open_as_the_interpreter_does(tmp_path):
    """A concurrent.futures pool that is never shut down (a reward client's) ends with the program: the
    interpreter's exit runs threading's atexit calls before it joins the threads; a plain join would wait
    for the pool's idle workers for ever."""
    (tmp_path / "pool.py").write_text("import concurrent.futures, threading\n"
                                      "pool = concurrent.futures.ThreadPoolExecutor(2)\n"
                                      "concurrent.futures.kept = pool  # a module's global, as a client's\n"
                                      "print(pool.submit(lambda: 6 * 7).result(), flush=True)\n"
                                      "threading.Thread(target=lambda: print('joined', flush=True)).start()\n")
    script = f"""
import sys
from megappo.parallel.fork import ForkedRank
print(ForkedRank((sys.executable, "-u", {str(tmp_path / "pool.py")!r}), {{}}, ({str(tmp_path / "pool.py")!r},), 0).wait())
"""
    fresh = subprocess.run([sys.executable, "-u", str(tmp_path / "pool.py")], capture_output=True, text=True, timeout=60)
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=REPO),
                          capture_output=True, text=True, timeout=60)
    assert fresh.stdout.split() == ["42", "joined"] and proc.stdout.split() == ["42", "joined", "0"], proc.stderr


def test_the_launchers_preload_starts_no_thread():
    script = ("from megappo.cli import _import_rank_modules\n_import_rank_modules()\n"
              "from megappo.parallel.fork import fork_blocker\nprint(fork_blocker())")
    proc = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stdout + proc.stderr
    assert "warn" not in proc.stderr.lower(), proc.stderr
