#!/usr/bin/env python
"""One command that checks a GPU machine: `make gpu-check` (benchmarks/GPU.md is the procedure).

    python benchmarks/gpu_check.py [--out DIR] [--smoke] [--budget SECONDS]

Runs, each as a subprocess with its own time limit, one after another, within `--budget` seconds
(570 by default: one 10-minute device call): the GPU-marked tests (`pytest -m gpu tests/unit`), then
benchmarks/gpu.py's sections: smoke (tiny fp32 model, every path), mfu (1B, with and without the chunked
LM head; one profiled call per update row in DIR/profile/), gen (1B: the hf engine's
dynamic / static / CUDA-graph decode and transformers' static cache + compile, 5 timed calls each), sync
(1B), and e2e
(`megappo train` on the 1.7B GRPO and 360M PPO recipes of benchmarks/gpu_e2e/, 6 steps each); gen512 (gen at
128 x (128 + 512) tokens) only when --parts names it. A part
that fails, passes its limit (its whole process group is killed: nothing of it keeps the GPU) or
cannot start is recorded with its exit code and log tail and the next one runs. gpu.py's parts get
`--time-limit` (their limit less 15 s): an e2e run still going then is killed and its row keeps the
steps it finished, so the part ends in time to write its JSON. grpo (e2e's 1.7B GRPO run alone) and gen1p7b
(gen at that model's shape, 128 x (32 + 512) tokens) only when --parts names them.
Writes, after every part, DIR/gpu-check.json (every part's status, seconds and rows) and
DIR/gpu-check.txt (the tables), DIR/<part>.log and DIR/<part>.json.

No registry is needed: wheels carried in `.whl/` (megatron-core, psutil, pytest and its requirements)
are unpacked into a site directory with zipfile, not pip, and put on PYTHONPATH; megappo runs from
the tree. `--smoke` runs the tests and gpu.py --smoke (every section) only: what
tests/e2e/test_gpu_bench_smoke.py runs on a CPU.

This script does not know what the sections measure: it runs them and gathers their JSON.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_PY = os.path.join(ROOT, "benchmarks", "gpu.py")

#: part -> (command after `python`, share of the budget); the shares of a full check add up to 1
FULL = {
    "tests": (["-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs", "tests/unit"], 0.06),
    "smoke": ([GPU_PY, "--smoke", "--sections", "mfu,gen,sync"], 0.07),
    "mfu": ([GPU_PY, "--sections", "mfu", "--sizes", "1b", "--steps", "3", "--profile-dir", "{out}/profile"], 0.10),
    "gen": ([GPU_PY, "--sections", "gen", "--gen-size", "1b", "--gen-prompt-len", "32", "--gen-new-tokens", "128",
                    "--gen-repeats", "5"], 0.30),  # short prompts, as RL prompts are: the windows show
    "sync": ([GPU_PY, "--sections", "sync", "--sizes", "1b", "--repeats", "2"], 0.07),
    "e2e": ([GPU_PY, "--sections", "e2e", "--e2e-timeout", "190"], 0.40),
    "gen512": ([GPU_PY, "--sections", "gen", "--gen-size", "1b", "--gen-batch", "128", "--gen-new-tokens", "512",
                "--gen-repeats", "3"], 0.30),
    "grpo": ([GPU_PY, "--sections", "e2e", "--e2e-recipes", "grpo-1p7b", "--e2e-timeout", "150"], 0.20),
    "gen1p7b": ([GPU_PY, "--sections", "gen", "--gen-size", "1p7b", "--gen-batch", "128", "--gen-prompt-len", "32",
                 "--gen-new-tokens", "512", "--gen-repeats", "3"], 0.30),
}
#: parts a check runs only when --parts names them: gen at issue 39's shape, 128 x (128 + 512) tokens, took
#: 175 s on an H200, more than a full check's 570 s leave it; grpo, e2e's 1.7B GRPO run alone (about 100 s),
#: for a short call after a change to generation (`--parts tests,grpo --budget 220`); gen1p7b, gen at the
#: grpo-1p7b model's shape and issue 39's 128 x 512 new tokens (the peer at that shape)
ON_REQUEST = {"gen512", "grpo", "gen1p7b"}
SMOKE = {
    "tests": FULL["tests"],
    "bench": ([GPU_PY, "--smoke", "--e2e-dir", "{out}/e2e", "--profile-dir", "{out}/profile"], 0.9),  # files kept to check
}


def unpack_wheels(wheel_dir: str, site: str) -> list[str]:
    """Every wheel in `wheel_dir` unzipped into `site` (a wheel is a zip of its site-packages files)."""
    names = []
    for wheel in sorted(glob.glob(os.path.join(wheel_dir, "*.whl"))):
        with zipfile.ZipFile(wheel) as z:
            z.extractall(site)
        names.append(os.path.basename(wheel))
    return names


def run_part(name: str, command: list[str], limit: float, out: str, env: dict) -> dict:
    sys.path.insert(0, os.path.dirname(GPU_PY))
    from gpu import run_until  # benchmarks/gpu.py: past the limit, the part's whole process group is killed

    part_json = os.path.join(out, f"{name}.json")
    command = [c.replace("{out}", out) for c in command]
    if command[0] == GPU_PY:  # gpu.py ends its e2e runs in time to write its JSON
        command = command + ["--json", part_json, "--time-limit", f"{max(limit - 15, 1):.0f}"]
    start = time.perf_counter()
    record = {"command": " ".join(command), "limit_s": round(limit)}
    try:
        rc, log = run_until([sys.executable, *command], env, limit, cwd=ROOT)
        record["rc"] = rc
        record["status"] = ("ok" if rc == 0 else f"error: passed its {limit:.0f} s" if rc is None
                            else f"error: exit code {rc}")
    except OSError as e:
        log, record["rc"], record["status"] = str(e), None, f"error: {e}"
    record["seconds"] = time.perf_counter() - start
    with open(os.path.join(out, f"{name}.log"), "w") as f:
        f.write(log)
    record["tail"] = log.strip().splitlines()[-15:]
    if os.path.exists(part_json):  # gpu.py writes its JSON after every section: kept even when cut short
        with open(part_json) as f:
            record["results"] = json.load(f)
    return record


def tables(report: dict) -> str:
    """The parts' status lines and every section's table, in gpu.py's format."""
    import contextlib
    import io

    sys.path.insert(0, os.path.dirname(GPU_PY))
    import gpu  # benchmarks/gpu.py

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print(f"gpu-check: {report['device']}, {report['seconds']:.0f} s of a {report['budget_s']:.0f} s budget")
        for name, part in report["parts"].items():
            print(f"  {name:10s} {part['status']:40s} {part['seconds']:6.0f} s")
        for name, part in report["parts"].items():
            for section, rows in part.get("results", {}).get("sections", {}).items():
                print(f"\n[{name}]", end="")
                gpu.print_table(section, [gpu.Row(**row) for row in rows])
    return text.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "gpu-check"),
                   help="where the JSON, the table and the logs go (default: $OUT, else ./gpu-check)")
    p.add_argument("--smoke", action="store_true", help="the tests and gpu.py --smoke only (CPU check of this script)")
    p.add_argument("--budget", type=float, default=570.0, help="seconds for all parts (default 570)")
    p.add_argument("--parts", help="comma-separated subset of the parts, in their order")
    p.add_argument("--wheels", default=os.path.join(ROOT, ".whl"), help="carried wheels to unpack (default .whl/)")
    args = p.parse_args(argv)
    parts = SMOKE if args.smoke else FULL
    if args.parts:
        chosen = [x for x in args.parts.split(",") if x]
        unknown = [x for x in chosen if x not in parts]
        if unknown or not chosen:
            p.error(f"--parts: {f'unknown {unknown}' if unknown else 'none given'}; choose from {list(parts)}")
        parts = {k: v for k, v in parts.items() if k in chosen}
    else:
        parts = {k: v for k, v in parts.items() if k not in ON_REQUEST}
    if args.budget <= 0:
        p.error("--budget must be > 0 seconds")
    os.makedirs(args.out, exist_ok=True)
    site = tempfile.mkdtemp(prefix="megappo-site-")  # not under --out: $OUT comes back from the device
    wheels = unpack_wheels(args.wheels, site)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        x for x in (site if wheels else None, ROOT, os.environ.get("PYTHONPATH")) if x))
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device (cpu)"
    report = {"device": device, "torch": torch.__version__, "wheels": wheels, "budget_s": args.budget,
              "parts": {}, "seconds": 0.0}
    start = time.perf_counter()
    shares_left = sum(s for _c, s in parts.values())
    for name, (command, part_share) in parts.items():
        left = args.budget - (time.perf_counter() - start)
        if left < 10:
            report["parts"][name] = {"status": "skipped: no time left in the budget", "seconds": 0.0}
        else:  # its share of what is left: time an earlier part did not use goes to the later ones
            report["parts"][name] = run_part(name, command, left * part_share / shares_left, args.out, env)
        shares_left -= part_share
        report["seconds"] = time.perf_counter() - start
        with open(os.path.join(args.out, "gpu-check.json"), "w") as f:
            json.dump(report, f, indent=1)
        print(f"gpu-check: {name}: {report['parts'][name]['status']} ({report['parts'][name]['seconds']:.0f} s)",
              flush=True)
    text = tables(report)
    with open(os.path.join(args.out, "gpu-check.txt"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(part["status"] == "ok" for part in report["parts"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
