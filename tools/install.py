#!/usr/bin/env python3
"""Install megappo for `make demo` / `make test`: the right torch build, then megappo, once.

What it does, in order:
  1. Decide the torch flavour: `--flavour cpu|cuda`, or `auto` (the default): cuda when
     `nvidia-smi` is on PATH, cpu otherwise.
  2. Skip everything when the stamp file (`<stamp-dir>/install.json`) says the same install
     was already done: same setup.py, torch spec, flavour, python, and the extras asked for
     are among those installed. A rerun then costs nothing (no pip at all).
  3. torch: an installed torch of the right flavour (a CPU build on a CPU machine, a CUDA
     build on a GPU machine) is kept as it is. Otherwise, on CPU, the pinned version from
     PyTorch's CPU wheel index (`--cpu-index`), probed first with a short timeout, falling
     back to the plain pin (`pip install torch==X`: what a registry mirror holding a `+cpu`
     wheel serves); on a GPU machine the plain pin from the default index (PyPI's Linux
     wheel is the CUDA build) or `--cuda-index`. One line says which source was used.
  4. megappo (`pip install -e .` or `-e .[extras]`) under a constraints file
     (`<stamp-dir>/constraints.txt`) that pins the installed torch version, so no dependency can
     pull a different torch, and every other package at the version the test suite last passed
     with (`--tested`, default constraints-tested.txt, written by tools/tested_set.py), so a new
     upstream release cannot change what a first run installs. `--tested ''` installs from
     setup.py's ranges instead (what `pip install -e .` by hand resolves).
  5. Write the stamp.

`--dry-run` prints the pip commands instead of running them (and neither probes the network
nor writes the stamp); `--python` names the interpreter to install into (default: this one).

This script does not know about megappo's code; it reads setup.py and the tested set only to key
the stamp.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TESTED = os.path.join(REPO, "constraints-tested.txt")
TORCH_PROBE = "import torch; print(torch.__version__); print(torch.version.cuda or '')"


def show(path: str) -> str:
    rel = os.path.relpath(path, REPO)
    return path if rel.startswith("..") else rel


def say(msg: str) -> None:
    print(f"install: {msg}", flush=True)


class Installer:
    def __init__(self, args):
        self.args = args
        self.python = shutil.which(args.python) or args.python

    def pip(self, *pip_args: str) -> bool:
        """Run `python -m pip install ...` (or print it under --dry-run); True on success."""
        cmd = [self.python, "-m", "pip", "install", "-q", *pip_args]
        if self.args.dry_run:
            print("would run: " + shlex.join(cmd), flush=True)
            return True
        return subprocess.run(cmd, cwd=REPO).returncode == 0

    def installed_torch(self) -> tuple[str, bool] | None:
        """(version, is_cuda_build) of the torch the target python imports, or None."""
        proc = subprocess.run([self.python, "-c", TORCH_PROBE], capture_output=True, text=True)
        if proc.returncode != 0:
            return None
        lines = proc.stdout.strip().splitlines()
        if not lines:
            return None
        return lines[0].strip(), len(lines) > 1 and bool(lines[1].strip())


def decide_flavour(flavour: str) -> str:
    if flavour in ("cpu", "cuda"):
        return flavour
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


def index_reachable(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=timeout):
            return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def interpreter(python: str) -> str:
    """Which environment `python` is: its sys.executable and sys.prefix (a pyenv shim or a
    `python` on PATH names different ones over time), and the executable's inode and mtime (a
    virtual environment deleted and made again at the same path is a new one)."""
    try:
        proc = subprocess.run([python, "-c", "import sys; print(sys.executable); print(sys.prefix)"],
                              capture_output=True, text=True)
        error = proc.stderr.strip()[-200:] if proc.returncode != 0 else ""
    except OSError as e:
        error = str(e)
    if error:
        raise SystemExit(f"install: error: the interpreter '{python}' does not run ({error}). Fix: name one that "
                         "does: make ... PYTHON=/path/to/python, or tools/install.py --python /path/to/python.")
    executable = proc.stdout.splitlines()[0]
    try:
        st = os.lstat(executable)
        return f"{proc.stdout.strip()}:{st.st_ino}:{st.st_mtime_ns}"
    except OSError:
        return proc.stdout.strip()


def tested_pins(path: str) -> list[str]:
    """The `name==version` lines of the tested set at `path` (none for ''), torch left out: the
    torch pin is the one installed (its build decides the flavour)."""
    if not path:
        return []
    try:
        with open(path) as f:
            lines = [line.split("#")[0].strip() for line in f]
    except OSError as e:
        raise SystemExit(f"install: error: cannot read the tested set {path} ({e.strerror}). Fix: name an existing "
                         "constraints file with --tested (make ... TESTED=FILE), or --tested '' for setup.py's "
                         "ranges.") from None
    return [line for line in lines if line and not line.lower().startswith(("torch==", "torch "))]


def stamp_key(args, flavour: str, where: str, pins: list[str]) -> str:
    h = hashlib.sha256()
    with open(os.path.join(REPO, "setup.py"), "rb") as f:
        h.update(f.read())
    h.update("\n".join(pins).encode())
    h.update(f"\0{args.torch}\0{args.flavour}:{flavour}\0{where}\0{args.cpu_index}\0{args.cuda_index}".encode())
    return h.hexdigest()


def read_stamp(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def fallback(inst: Installer, args, req: list[str], why: str) -> str:
    """The plain pin from pip's configured index (a mirror may hold the `+cpu` wheel)."""
    if not inst.pip(*req):
        raise SystemExit(f"install: error: could not install {args.torch} from {args.cpu_index} nor from the "
                         "default index. Fix: check the network or pip's index settings (pip config list).")
    return f"the default index (pip install {args.torch}; {args.cpu_index} {why})"


def install_torch(inst: Installer, args, flavour: str) -> str | None:
    """Make sure a torch of the right flavour is installed; its version (None under --dry-run
    when none is installed yet). A CUDA build found on a machine without nvidia-smi is kept
    (it runs on CPU too, and the environment may be meant for a GPU machine) unless
    `--flavour cpu` asks for the CPU build; a CPU build on a GPU machine is always replaced."""
    have = inst.installed_torch()
    if have is not None and have[1] == (flavour == "cuda"):
        say(f"torch {have[0]} already installed ({'CUDA' if have[1] else 'CPU'} build): kept")
        return have[0]
    if have is not None and have[1] and args.flavour == "auto":
        say(f"torch {have[0]} already installed (a CUDA build, no nvidia-smi here; it runs on CPU): kept. "
            "MEGAPPO_TORCH=cpu replaces it with the CPU build")
        return have[0]
    req = [args.torch]
    if have is not None:  # the same version of the other build counts as installed: replace it
        say(f"torch {have[0]} is a {'CUDA' if have[1] else 'CPU'} build on a {flavour.upper()} machine: "
            f"replacing it with {args.torch} for {flavour.upper()}")
        req.append("--force-reinstall")
    if flavour == "cpu":
        if args.dry_run:
            inst.pip(*req, "--index-url", args.cpu_index)
            print(f"would run if that fails: {shlex.join([inst.python, '-m', 'pip', 'install', '-q', *req])}")
            source = f"PyTorch's CPU index {args.cpu_index}"
        elif not index_reachable(args.cpu_index, args.probe_timeout):
            source = fallback(inst, args, req, "was not reachable")
        elif inst.pip(*req, "--index-url", args.cpu_index):
            source = f"PyTorch's CPU index {args.cpu_index}"
        else:
            source = fallback(inst, args, req, "failed")
    else:
        extra = ("--index-url", args.cuda_index) if args.cuda_index else ()
        if not inst.pip(*req, *extra):
            raise SystemExit(f"install: error: could not install {args.torch} (CUDA). Fix: install a CUDA torch "
                             "first (https://pytorch.org/get-started/locally/) and run this again.")
        source = args.cuda_index or f"the default index (pip install {args.torch}: the CUDA build on Linux)"
    say(f"torch for {flavour.upper()} from {source}")
    if args.dry_run:
        return have[0] if have else None
    have = inst.installed_torch()
    if have is None:
        raise SystemExit(f"install: error: torch does not import after installing {args.torch}.")
    if have[1] != (flavour == "cuda"):
        say(f"warning: the installed torch {have[0]} is a {'CUDA' if have[1] else 'CPU'} build on a "
            f"{flavour.upper()} machine. Fix: pick the build with MEGAPPO_TORCH=cpu|cuda, and the index with "
            "TORCH_CUDA_INDEX (make) or --cpu-index / --cuda-index (tools/install.py).")
    return have[0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--extras", default="", help="comma-separated setup.py extras, e.g. 'test' (default: none)")
    p.add_argument("--torch", default="torch==2.13.0", help="the torch requirement (default: torch==2.13.0)")
    p.add_argument("--flavour", default="auto", choices=["auto", "cpu", "cuda"],
                   help="torch build: auto = cuda when nvidia-smi is on PATH, else cpu")
    p.add_argument("--cpu-index", default=CPU_INDEX, help=f"CPU wheel index tried first on CPU (default {CPU_INDEX})")
    p.add_argument("--cuda-index", default="", help="wheel index for the CUDA build (default: pip's default index)")
    p.add_argument("--probe-timeout", type=float, default=3.0, help="seconds to wait for the CPU index (default 3)")
    p.add_argument("--python", default=sys.executable, help="interpreter to install into (default: this one)")
    p.add_argument("--stamp-dir", default=os.path.join(REPO, ".make"), help="where the stamp and constraints go")
    p.add_argument("--tested", default=TESTED,
                   help=f"constraints file of the tested versions (default {show(TESTED)}); '' for setup.py's ranges")
    p.add_argument("--dry-run", action="store_true", help="print the pip commands instead of running them")
    p.add_argument("--torch-only", action="store_true",
                   help="install the torch build only, no stamp (the CPU SGLang lane's virtualenv)")
    args = p.parse_args(argv)
    if args.torch_only:
        install_torch(Installer(args), args, decide_flavour(args.flavour))
        return 0

    start = time.monotonic()
    inst = Installer(args)
    flavour = decide_flavour(args.flavour)
    extras = sorted(e for e in (x.strip() for x in args.extras.split(",")) if e)
    stamp_path = os.path.join(args.stamp_dir, "install.json")
    pins = tested_pins(args.tested)
    key = stamp_key(args, flavour, interpreter(inst.python), pins)
    stamp = read_stamp(stamp_path)
    if stamp.get("key") == key and set(extras) <= set(stamp.get("extras", [])):
        say(f"up to date (torch {stamp.get('torch')}, {flavour.upper()}; extras {stamp.get('extras')}): nothing to "
            f"do; delete {show(stamp_path)} to reinstall")
        return 0

    version = install_torch(inst, args, flavour)
    constraints = os.path.join(args.stamp_dir, "constraints.txt")
    pin = f"torch=={version}" if version else args.torch
    if not args.dry_run:
        os.makedirs(args.stamp_dir, exist_ok=True)
        with open(constraints, "w") as f:
            f.write("".join(line + "\n" for line in [pin, *pins]))
    target = "." + (f"[{','.join(extras)}]" if extras else "")
    if not inst.pip("-c", constraints, "-e", target):
        held = f"torch held at {pin}" + (f", the rest at the tested set {show(args.tested)}" if pins else "")
        fix = ("read pip's message above. Where a tested version does not exist for this Python or platform, "
               "install from setup.py's ranges instead: make ... TESTED= (tools/install.py --tested '')"
               if pins else "read pip's message above.")
        raise SystemExit(f"install: error: pip install -e {target} failed ({held}). Fix: {fix}.")
    if args.dry_run:
        return 0
    with open(stamp_path + ".tmp", "w") as f:
        done = sorted(set(extras) | set(stamp.get("extras", []) if stamp.get("key") == key else []))
        json.dump({"key": key, "extras": done, "torch": version, "flavour": flavour}, f)
    os.replace(stamp_path + ".tmp", stamp_path)
    tested = f", {len(pins)} packages at the tested versions of {show(args.tested)}" if pins else \
        ", the rest from setup.py's ranges"
    say(f"megappo installed ({target}, torch {version} held by {show(constraints)}{tested}) "
        f"in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
