"""tools/install.py, tools/tested_set.py and the Makefile's install steps (docs/install.md), run for
real against a fake interpreter: the fake answers the torch probe from a state file and logs every
`-m pip` / `-m pytest` call instead of running it, so nothing touches the shared environment or the
network (the "CPU wheel index" is a local HTTP server, or a closed port for an unreachable one).
Reading installed packages' metadata (tested_set.py) runs in this interpreter's environment."""

import functools
import http.server
import json
import os
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "tools", "install.py")
TESTED = os.path.join(REPO, "constraints-tested.txt")
UNREACHABLE = "http://127.0.0.1:9/whl/cpu"  # the discard port: connection refused at once
pytestmark = pytest.mark.one_process  # tools/install.py and make with a fake interpreter (tests/conftest.py)

FAKE_PYTHON = r'''#!{python}
import json, os, sys
args = sys.argv[1:]
if args and args[0].endswith(".py"):  # the Makefile runs tools/install.py with $(PYTHON)
    os.execv({python!r}, [{python!r}] + args)
if args[:1] == ["-c"] and "metadata" in args[1]:  # tested_set.py reads the installed packages
    os.execv({python!r}, [{python!r}] + args)
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps(args) + "\n")
state = os.environ["FAKE_STATE"]
if args[:2] == ["-m", "venv"]:  # a virtualenv: a copy of this fake
    os.makedirs(os.path.join(args[2], "bin"))
    me = os.path.join(args[2], "bin", "python")
    open(me, "w").write(open(sys.argv[0]).read())
    os.chmod(me, 0o755)
elif args[:2] == ["-m", "pytest"]:
    sys.exit(int(os.environ.get("FAKE_PYTEST_RC", "0")))
elif args[:1] == ["-c"] and "sys.prefix" in args[1]:  # which environment this is
    print(os.path.abspath(sys.argv[0])); print(os.path.dirname(os.path.abspath(sys.argv[0])))
elif args[:1] == ["-c"]:  # the torch probe: version, then CUDA version (empty for a CPU build)
    torch = open(state).read().split() if os.path.exists(state) else []
    if not torch:
        sys.exit(1)
    print(torch[0]); print(torch[1] if len(torch) > 1 else "")
elif args[:3] == ["-m", "pip", "install"]:
    if "--index-url" in args and os.environ.get("FAKE_INDEX_PIP_FAILS"):
        sys.exit(1)
    if "-e" in args and os.environ.get("FAKE_MEGAPPO_PIP_FAILS"):
        sys.exit(1)
    if any(a.startswith("torch==") for a in args):
        new = "2.13.0+cpu" if "--index-url" in args else os.environ.get("FAKE_PLAIN_TORCH", "2.13.0+cpu")
        open(state, "w").write(new)
'''


def pins_of(path=TESTED):
    """The pins install.py merges from a tested-set file: its lines less comments, blanks and torch."""
    lines = [line.split("#")[0].strip() for line in open(path)]
    return [line for line in lines if line and not line.startswith("torch==")]


class Fake:
    def __init__(self, tmp_path, torch=None, nvidia_smi=False):
        self.dir = tmp_path
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.python = self.bin / "python"
        self.python.write_text(FAKE_PYTHON.format(python=sys.executable))
        self.python.chmod(0o755)
        if nvidia_smi:
            (self.bin / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
            (self.bin / "nvidia-smi").chmod(0o755)
        self.log = tmp_path / "calls.jsonl"
        self.state = tmp_path / "torch.txt"
        if torch:
            self.state.write_text(torch)
        self.stamps = tmp_path / "stamps"
        self.env = dict(os.environ, FAKE_LOG=str(self.log), FAKE_STATE=str(self.state),
                        PATH=f"{self.bin}:/usr/bin:/bin")
        self.env.pop("MEGAPPO_TORCH", None)

    def run(self, *args, cpu_index=UNREACHABLE, python=None, **env):
        self.log.write_text("")
        cmd = [sys.executable, SCRIPT, "--python", str(python or self.python), "--stamp-dir", str(self.stamps),
               "--cpu-index", cpu_index, "--probe-timeout", "2", *args]
        start = time.monotonic()
        proc = subprocess.run(cmd, env=dict(self.env, **env), cwd=REPO, capture_output=True, text=True, timeout=120)
        self.seconds = time.monotonic() - start
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    def constraints(self):
        """The torch pin install.py wrote, after checking the rest is the tested set."""
        lines = (self.stamps / "constraints.txt").read_text().splitlines()
        assert lines[1:] == pins_of()
        return lines[0]

    def pip_calls(self):
        calls = [json.loads(line) for line in self.log.read_text().splitlines()]
        return [c[3:] for c in calls if c[:3] == ["-m", "pip", "install"]]


@pytest.fixture
def cpu_index(tmp_path):
    """A reachable 'CPU wheel index': a local HTTP server with a torch/ page."""
    root = tmp_path / "index"
    (root / "whl" / "cpu" / "torch").mkdir(parents=True)
    (root / "whl" / "cpu" / "torch" / "index.html").write_text("<html></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/whl/cpu"
    server.shutdown()


def test_cpu_machine_uses_the_cpu_index_and_holds_torch(tmp_path, cpu_index):
    fake = Fake(tmp_path)  # no torch, no nvidia-smi
    out = fake.run(cpu_index=cpu_index)
    assert fake.pip_calls() == [["-q", "torch==2.13.0", "--index-url", cpu_index],
                                ["-q", "-c", str(fake.stamps / "constraints.txt"), "-e", "."]]
    assert f"torch for CPU from PyTorch's CPU index {cpu_index}" in out
    assert fake.constraints() == "torch==2.13.0+cpu"


def test_cpu_machine_falls_back_to_the_plain_pin(tmp_path, cpu_index):
    fake = Fake(tmp_path)
    out = fake.run()  # the CPU index cannot be reached: the probe fails fast, no pip call goes there
    assert fake.pip_calls()[0] == ["-q", "torch==2.13.0"]
    assert "from the default index (pip install torch==2.13.0; " + UNREACHABLE + " was not reachable)" in out
    assert fake.seconds < 30
    fake.stamps.joinpath("install.json").unlink()
    fake.state.unlink()
    out = fake.run(cpu_index=cpu_index, FAKE_INDEX_PIP_FAILS="1")  # reachable, but pip fails there: the fallback
    assert f"from the default index (pip install torch==2.13.0; {cpu_index} failed)" in out
    assert [c[:4] for c in fake.pip_calls()[:2]] == [["-q", "torch==2.13.0", "--index-url", cpu_index],
                                                     ["-q", "torch==2.13.0"]]


def test_dry_run_prints_the_index_first_then_the_fallback(tmp_path):
    fake = Fake(tmp_path)
    out = fake.run("--dry-run", "--cpu-index", "https://download.pytorch.org/whl/cpu")
    lines = [line for line in out.splitlines() if line.startswith("would run")]
    assert lines[0].endswith("-m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu")
    assert lines[1].startswith("would run if that fails:") and lines[1].endswith("-m pip install -q torch==2.13.0")
    assert lines[2].endswith("-e .")
    assert fake.pip_calls() == [] and not (fake.stamps / "install.json").exists()


def test_a_cuda_torch_on_a_cpu_machine_is_kept_unless_cpu_is_asked_for(tmp_path):
    fake = Fake(tmp_path, torch="2.13.0 12.8")
    out = fake.run()
    assert "a CUDA build, no nvidia-smi here; it runs on CPU): kept" in out
    assert fake.pip_calls() == [["-q", "-c", str(fake.stamps / "constraints.txt"), "-e", "."]]
    fake.run("--flavour", "cpu")
    assert fake.pip_calls()[0] == ["-q", "torch==2.13.0", "--force-reinstall"]  # the CPU index is unreachable
    assert fake.constraints() == "torch==2.13.0+cpu"


def test_a_fitting_torch_is_kept(tmp_path):
    fake = Fake(tmp_path, torch="2.12.1+cpu")
    out = fake.run("--extras", "test")
    assert "torch 2.12.1+cpu already installed (CPU build): kept" in out
    assert fake.pip_calls() == [["-q", "-c", str(fake.stamps / "constraints.txt"), "-e", ".[test]"]]
    assert fake.constraints() == "torch==2.12.1+cpu"


@pytest.mark.parametrize("how", ["nvidia-smi", "override"])
def test_gpu_machine_gets_the_cuda_build(tmp_path, how):
    fake = Fake(tmp_path, torch="2.13.0+cpu", nvidia_smi=how == "nvidia-smi")
    args = ("--flavour", "cuda") if how == "override" else ()
    out = fake.run(*args, FAKE_PLAIN_TORCH="2.13.0 12.8")
    assert "CPU build on a CUDA machine" in out
    calls = fake.pip_calls()
    assert calls[0] == ["-q", "torch==2.13.0", "--force-reinstall"]  # no CPU index
    assert fake.constraints() == "torch==2.13.0"
    fake.stamps.joinpath("install.json").unlink()
    fake.run(*args)  # a CUDA build already there is kept
    assert fake.pip_calls() == [["-q", "-c", str(fake.stamps / "constraints.txt"), "-e", "."]]


def test_rerun_skips_pip_until_something_changes(tmp_path):
    fake = Fake(tmp_path)
    fake.run("--extras", "test")
    assert fake.pip_calls()
    out = fake.run("--extras", "test")
    assert fake.pip_calls() == [] and "up to date" in out
    assert fake.run() and fake.pip_calls() == []  # `make demo` after `make test`: megappo is there
    fake.run("--torch", "torch==2.12.1")  # another torch spec: a new install
    assert fake.pip_calls()
    other = tmp_path / "venv2" / "python"  # another environment: a new install
    other.parent.mkdir()
    other.write_text(fake.python.read_text())
    other.chmod(0o755)
    fake.run(python=other)
    assert fake.pip_calls()


def test_demo_then_test_adds_the_test_extras(tmp_path):
    fake = Fake(tmp_path, torch="2.13.0+cpu")
    fake.run()
    assert fake.pip_calls()[-1][-1] == "."
    fake.run("--extras", "test")
    assert fake.pip_calls() == [["-q", "-c", str(fake.stamps / "constraints.txt"), "-e", ".[test]"]]
    fake.run()
    assert fake.pip_calls() == []


def test_make_demo_and_make_test(tmp_path):
    """The Makefile's targets through the fake interpreter: demo installs megappo without the
    test extras, test with them; a second `make demo` runs no pip."""
    fake = Fake(tmp_path, torch="2.13.0+cpu")
    make = ["make", "-s", f"PYTHON={fake.python}", f"STAMP_DIR={fake.stamps}"]

    def run(target):
        fake.log.write_text("")
        proc = subprocess.run(make + [target], env=fake.env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return [json.loads(line) for line in fake.log.read_text().splitlines()]

    calls = run("demo")
    assert ["-m", "pip", "install", "-q", "-c", str(fake.stamps / "constraints.txt"), "-e", "."] in calls
    assert calls[-1] == ["-m", "megappo.cli", "train", "recipes/demo-cpu.yaml"]
    assert not any(c[:2] == ["-m", "pip"] for c in run("demo"))
    make.append("SGLANG_LANE=")  # the SGLang lane builds a real virtualenv: its own tests (tests/sglang)
    calls = run("test")
    assert ["-m", "pip", "install", "-q", "-c", str(fake.stamps / "constraints.txt"), "-e", ".[test]"] in calls
    assert calls[-1][:3] == ["-m", "pytest", "-q"]
    assert fake.constraints() == "torch==2.13.0+cpu"  # and the tested set (a fresh `make test` installs under it)
    assert any(line.startswith("transformers==") for line in pins_of())
    plain = {k: v for k, v in os.environ.items() if k not in ("SGLANG_LANE", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    lane = subprocess.run(["make", "-n", "test"], cwd=REPO, env=plain, capture_output=True, text=True, timeout=60)
    assert "test-sglang" in lane.stdout  # a plain `make test` ends with the lane


def test_an_interpreter_that_does_not_run_is_named(tmp_path):
    proc = subprocess.run([sys.executable, SCRIPT, "--python", str(tmp_path / "nope"), "--stamp-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert f"the interpreter '{tmp_path / 'nope'}' does not run" in proc.stderr and "PYTHON=" in proc.stderr


def test_the_tested_set_is_merged_with_the_torch_pin(tmp_path):
    fake = Fake(tmp_path, torch="2.13.0+cpu")
    tested = tmp_path / "tested.txt"
    tested.write_text("# a comment\ntorch==9.9\nfoo==1.0  # why\n\nbar==2.0\n")
    out = fake.run("--tested", str(tested))
    assert (fake.stamps / "constraints.txt").read_text() == "torch==2.13.0+cpu\nfoo==1.0\nbar==2.0\n"
    assert f"2 packages at the tested versions of {tested}" in out
    assert fake.run("--tested", str(tested)) and fake.pip_calls() == []  # a rerun: nothing to do
    tested.write_text("foo==1.1\nbar==2.0\n")  # the set is updated: a new install
    fake.run("--tested", str(tested))
    assert fake.pip_calls() and "foo==1.1" in (fake.stamps / "constraints.txt").read_text()
    out = fake.run("--tested", "")  # setup.py's ranges: torch held, nothing else
    assert (fake.stamps / "constraints.txt").read_text() == "torch==2.13.0+cpu\n" and "setup.py's ranges" in out


def test_a_failed_install_under_the_tested_set_names_the_way_out(tmp_path):
    fake = Fake(tmp_path, torch="2.13.0+cpu")
    proc = subprocess.run([sys.executable, SCRIPT, "--python", str(fake.python), "--stamp-dir", str(fake.stamps)],
                          env=dict(fake.env, FAKE_MEGAPPO_PIP_FAILS="1"), cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "the rest at the tested set constraints-tested.txt" in proc.stderr
    assert "make ... TESTED= (tools/install.py --tested '')" in proc.stderr
    proc = subprocess.run([sys.executable, SCRIPT, "--python", str(fake.python), "--stamp-dir", str(fake.stamps),
                           "--tested", str(tmp_path / "nope.txt")], env=fake.env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "cannot read the tested set" in proc.stderr and "TESTED=FILE" in proc.stderr


def test_freeze_writes_this_environment_and_drift_reads_it(tmp_path):
    tool = os.path.join(REPO, "tools", "tested_set.py")
    out = tmp_path / "tested.txt"
    proc = subprocess.run([sys.executable, tool, "freeze", "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    import transformers

    pins = pins_of(out)
    assert f"transformers=={transformers.__version__}" in pins and "megatron-core==0.16.1" in pins
    assert not any(p.startswith(("torch==", "megappo==")) for p in pins)
    assert out.read_text().startswith("# The versions megappo's test suite last passed with.")
    out.write_text(out.read_text().replace(f"transformers=={transformers.__version__}", "transformers==0.0.1"))
    proc = subprocess.run([sys.executable, tool, "drift", "--tested", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0
    assert proc.stdout.splitlines()[1:] == [f"  transformers 0.0.1 -> {transformers.__version__}"]


@pytest.mark.parametrize("unit_tests_pass", [True, False])
def test_make_test_latest(tmp_path, unit_tests_pass):
    """`make test-latest`: a virtualenv of its own, torch kept at the pin, every other package
    upgraded to the newest release, the unit tests there, and what drifted from the tested set."""
    import transformers

    fake = Fake(tmp_path, torch="2.13.0+cpu")
    tested = tmp_path / "tested.txt"
    tested.write_text(open(TESTED).read().replace(f"transformers=={transformers.__version__}", "transformers==0.0.1"))
    proc = subprocess.run(["make", "-s", f"PYTHON={fake.python}", f"STAMP_DIR={fake.stamps}", f"TESTED={tested}",
                           "test-latest"], env=dict(fake.env, FAKE_PYTEST_RC="0" if unit_tests_pass else "1"),
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (proc.returncode == 0) == unit_tests_pass, proc.stdout + proc.stderr
    venv = fake.stamps / "latest"
    calls = [json.loads(line) for line in fake.log.read_text().splitlines()]
    assert calls[0] == ["-m", "venv", str(venv)]
    pip = [c for c in calls if c[:3] == ["-m", "pip", "install"]]
    assert pip == [["-m", "pip", "install", "-q", "--upgrade", "--upgrade-strategy", "eager", "-c",
                    str(venv / "torch-constraint.txt"), "-e", ".[test]"]]  # torch kept: no pip call for it
    assert (venv / "torch-constraint.txt").read_text() == "torch==2.13.0+cpu\n"
    assert calls[-1] == ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit"]
    verdict = "passed" if unit_tests_pass else "FAILED"
    assert f"the unit tests {verdict} against the newest releases (torch 2.13.0+cpu)" in proc.stdout
    assert f"  transformers 0.0.1 -> {transformers.__version__}" in proc.stdout
    assert ("to adopt them: python tools/tested_set.py freeze --python" in proc.stdout) == unit_tests_pass
