"""The Debian packages `make test` needs beyond pip: SLURM and munge, for the local cluster of
tests/e2e/test_slurm.py (tests/slurm_helpers.py: PACKAGES, and the BINARIES that show them installed).

`make test` runs this before pytest. With every binary on the machine it returns at once (no apt-get
call). A missing one on a root machine with apt-get installs PACKAGES (`apt-get update`, then
`apt-get install -y`); an install that fails, or leaves a binary missing, ends `make test` here with the
packages' names. Not root: nothing is installed and the SLURM tests skip (a local SLURM needs root).
The tests' fixture only checks; it never installs.

This script does not know about megappo.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.slurm_helpers import INSTALL, PACKAGES, missing_binaries  # noqa: E402


def main() -> int:
    missing = missing_binaries()
    if not missing:
        return 0
    if os.name != "posix" or os.geteuid() != 0:
        print(f"system packages: {', '.join(PACKAGES)} not installed ({', '.join(missing)} missing) and this is not "
              "root: the SLURM tests will skip (a local SLURM needs root)", file=sys.stderr)
        return 0
    if not shutil.which("apt-get"):
        print(f"system packages: {', '.join(missing)} missing and there is no apt-get. Fix: install "
              f"{', '.join(PACKAGES)} with this system's package manager, then run make test again.", file=sys.stderr)
        return 1
    print(f"system packages: installing {', '.join(PACKAGES)} ({', '.join(missing)} missing)", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *PACKAGES]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print((proc.stdout + proc.stderr)[-3000:], file=sys.stderr)
            print(f"system packages: `{' '.join(cmd)}` failed (above) installing {', '.join(PACKAGES)}. Fix: run "
                  f"`{INSTALL}` as root, then run make test again.", file=sys.stderr)
            return 1
    still = missing_binaries()
    if still:
        print(f"system packages: {', '.join(still)} still missing after `{INSTALL}`. Fix: install the packages "
              f"that provide them ({', '.join(PACKAGES)}), then run make test again.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
