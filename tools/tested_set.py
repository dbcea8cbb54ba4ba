#!/usr/bin/env python3
"""The tested set: the versions the test suite last passed with (constraints-tested.txt). `make demo`
and `make test` install under it (tools/install.py), so an upstream release cannot change what a
first run or CI installs; setup.py keeps ranges for installs by hand. docs/install.md says how the
set is updated.

  freeze --python PY   write the tested set from PY's environment: every package megappo[test]
                       pulls in (setup.py's requirements, then their dependencies as installed),
                       torch left out (the Makefile's TORCH pins it and its build decides its own
                       dependencies)
  drift --python PY    list the packages PY has at other versions than the tested set
  latest               `make test-latest`: a virtualenv of its own (--venv), torch at the pin and
                       every other package at the newest release setup.py's ranges allow, the unit
                       tests run there, then what drifted from the tested set. Not part of CI.

This script does not know about megappo's code; it reads setup.py's requirements and the installed
packages' metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import runpy
import shlex
import subprocess
import sys
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTED = os.path.join(REPO, "constraints-tested.txt")
SKIP = ("torch", "megappo")

# Run inside the environment being read: the installed version of every package that the root
# requirements (argv[1], JSON) pull in, following each package's own requirements and extras.
WALK = r'''
import json, sys
from importlib import metadata
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

roots, skip = json.loads(sys.argv[1]), set(sys.argv[2].split(","))
extras, missing = {}, []
queue = [Requirement(r) for r in roots]
while queue:
    req = queue.pop()
    name = canonicalize_name(req.name)
    if name in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    if name in extras and set(req.extras) <= extras[name]:
        continue
    extras[name] = extras.get(name, set()) | set(req.extras)
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        missing.append(name)
        continue
    for line in dist.requires or []:
        sub = Requirement(line)
        if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in extras[name] | {""}):
            sub.marker = None
            queue.append(sub)
versions = {n: metadata.version(n) for n in extras if n not in missing}
print(json.dumps({"versions": dict(sorted(versions.items())), "missing": sorted(set(missing)),
                  "python": "%d.%d" % sys.version_info[:2]}))
'''


def show(path: str) -> str:
    """`path` relative to the repository when it is inside it."""
    if not path:
        return "an empty tested set"
    rel = os.path.relpath(path, REPO)
    return path if rel.startswith("..") else rel


def say(msg: str) -> None:
    print(f"tested-set: {msg}", flush=True)


def setup_requirements(extras: list[str]) -> list[str]:
    """setup.py's install_requires plus the requirements of `extras`."""
    captured: dict = {}
    with mock.patch("setuptools.setup", lambda **kw: captured.update(kw)):
        runpy.run_path(os.path.join(REPO, "setup.py"))
    reqs = list(captured.get("install_requires", []))
    for extra in extras:
        if extra not in captured.get("extras_require", {}):
            raise SystemExit(f"tested-set: error: setup.py has no extra '{extra}'. Fix: choose from "
                             f"{sorted(captured.get('extras_require', {}))}.")
        reqs += captured["extras_require"][extra]
    return reqs


def installed(python: str, extras: list[str]) -> dict:
    """{"versions": {name: version}, "missing": [...], "python": "3.11"} of `python`'s environment."""
    proc = subprocess.run([python, "-c", WALK, json.dumps(setup_requirements(extras)), ",".join(SKIP)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"tested-set: error: could not read the packages of '{python}': "
                         f"{proc.stderr.strip()[-500:]}. Fix: name an interpreter with megappo's requirements "
                         "installed (make test installs them).")
    return json.loads(proc.stdout)


def read_tested(path: str) -> dict[str, str]:
    """{name: version} of a tested-set file (none for '')."""
    pins = {}
    if not path:
        return pins
    with open(path) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if line:
                name, _, version = line.partition("==")
                pins[re.sub(r"[-_.]+", "-", name.strip()).lower()] = version.strip()  # PEP 503 names
    return pins


def drift(versions: dict[str, str], tested: dict[str, str]) -> list[str]:
    """One line per package whose version is not the tested one (new, changed or gone)."""
    lines = []
    for name in sorted(set(versions) | set(tested)):
        old, new = tested.get(name), versions.get(name)
        if old == new:
            continue
        if old is None:
            lines.append(f"{name} {new} (not in the tested set)")
        elif new is None:
            lines.append(f"{name} {old} (tested; not installed now)")
        else:
            lines.append(f"{name} {old} -> {new}")
    return lines


def freeze(args) -> int:
    env = installed(args.python, args.extras)
    if env["missing"]:
        raise SystemExit(f"tested-set: error: {env['missing']} are required but not installed in '{args.python}'. "
                         "Fix: install megappo with the test extras there first (make test).")
    torch = subprocess.run([args.python, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True).stdout.strip() or "not installed"
    header = [
        "# The versions megappo's test suite last passed with. `make demo` and `make test` install under",
        "# this file (tools/install.py); setup.py keeps the ranges. How it is updated: docs/install.md.",
        f"# Written by tools/tested_set.py freeze: every package megappo[{','.join(args.extras)}] pulls in,",
        f"# torch left out (the Makefile's TORCH pins it). Python {env['python']}, {platform.system()} "
        f"{platform.machine()}, torch {torch}.",
    ]
    with open(args.out + ".tmp", "w") as f:
        f.write("\n".join(header + [f"{n}=={v}" for n, v in env["versions"].items()]) + "\n")
    os.replace(args.out + ".tmp", args.out)
    say(f"wrote {len(env['versions'])} pins to {show(args.out)}")
    return 0


def show_drift(args) -> int:
    lines = drift(installed(args.python, args.extras)["versions"], read_tested(args.tested))
    say(f"{len(lines)} packages differ from {show(args.tested)}" + (":" if lines else ""))
    for line in lines:
        print("  " + line)
    return 0


def run(cmd: list[str], **kw) -> int:
    print("+ " + shlex.join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO, **kw).returncode


def latest(args) -> int:
    venv = os.path.abspath(args.venv)
    vpy = os.path.join(venv, "bin", "python")
    if not os.path.exists(vpy) and run([args.python, "-m", "venv", venv]) != 0:
        raise SystemExit(f"tested-set: error: could not create the virtualenv {venv}. Fix: install the venv module "
                         "(e.g. apt install python3-venv) or name another interpreter with PYTHON=.")
    # torch at the pin, of the machine's build; kept when it is there already (only the first run downloads)
    if run([sys.executable, os.path.join(REPO, "tools", "install.py"), "--python", vpy, "--torch", args.torch,
            "--flavour", args.flavour, "--cuda-index", args.cuda_index, "--torch-only"]) != 0:
        raise SystemExit("tested-set: error: torch could not be installed in the virtualenv (above).")
    version = subprocess.run([vpy, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    held = os.path.join(venv, "torch-constraint.txt")
    with open(held, "w") as f:
        f.write(f"torch=={version}\n" if version else args.torch + "\n")
    target = "." + (f"[{','.join(args.extras)}]" if args.extras else "")
    if run([vpy, "-m", "pip", "install", "-q", "--upgrade", "--upgrade-strategy", "eager", "-c", held,
            "-e", target]) != 0:
        raise SystemExit(f"tested-set: error: the newest releases of megappo{target[1:]}'s requirements do not "
                         "install together (pip's message above): that is the drift to fix in setup.py.")
    lines = drift(installed(vpy, args.extras)["versions"], read_tested(args.tested))
    code = run([vpy, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args.tests])
    tested = show(args.tested)
    say(f"the unit tests {'passed' if code == 0 else 'FAILED'} against the newest releases (torch {version}); "
        f"{len(lines)} packages differ from {tested}" + (":" if lines else ""))
    for line in lines:
        print("  " + line)
    if lines and code == 0:
        say(f"to adopt them: python tools/tested_set.py freeze --python {show(vpy)}, then "
            "make test passing with them (docs/install.md)")
    return code


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n")[1])
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--python", default=sys.executable, help="the environment's interpreter (default: this one)")
    common.add_argument("--extras", default="test", type=lambda s: [e for e in s.split(",") if e],
                        help="setup.py extras whose requirements count (default: test)")
    common.add_argument("--tested", default=TESTED, help="the tested-set file (default: constraints-tested.txt)")
    f = sub.add_parser("freeze", parents=[common], help="write the tested set from an environment")
    f.add_argument("--out", default=TESTED, help="where to write it (default: constraints-tested.txt)")
    sub.add_parser("drift", parents=[common], help="list the packages at other versions than the tested set")
    lt = sub.add_parser("latest", parents=[common], help="the unit tests against the newest releases")
    lt.add_argument("--venv", default=os.path.join(REPO, ".make", "latest"),
                    help="the virtualenv (default .make/latest)")
    lt.add_argument("--torch", default="torch==2.13.0", help="the torch requirement (default: torch==2.13.0)")
    lt.add_argument("--flavour", default="auto", choices=["auto", "cpu", "cuda"], help="torch build (tools/install.py)")
    lt.add_argument("--cuda-index", default="", help="wheel index for the CUDA build (tools/install.py)")
    lt.add_argument("--tests", nargs="+", default=["tests/unit"], help="what pytest runs (default: tests/unit)")
    args = p.parse_args(argv)
    return {"freeze": freeze, "drift": show_drift, "latest": latest}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
