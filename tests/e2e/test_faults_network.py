"""What a run opens to the network: `megappo train` on one machine listens on loopback only.

A 2-rank run of the CPU demo (megappo's own launcher: torchrun in-process, one node); while it
runs, the listening TCP sockets of the launcher and every process under it are collected
(psutil), and each must be on 127.0.0.1 or ::1: torchrun's rendezvous store and the store the
ranks share (megappo.parallel.listen), and gloo's own sockets (GLOO_SOCKET_IFNAME=lo). Before,
the stores listened on `*:PORT` (every interface, IPv4 and IPv6). docs/launchers.md.
"""

import ipaddress
import os
import subprocess
import sys
import time

import psutil

from tests import prefork

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def listening(proc: psutil.Process) -> set[tuple[str, int, int]]:
    """(address, port, pid) of every listening TCP socket of `proc` and its descendants."""
    found = set()
    try:
        family = [proc, *proc.children(recursive=True)]
    except psutil.Error:  # the launcher ended, or a child went while its children were listed
        return found
    for p in family:
        try:
            found |= {(c.laddr.ip, c.laddr.port, p.pid) for c in p.net_connections("inet")
                      if c.status == psutil.CONN_LISTEN}
        except psutil.Error:  # it ended meanwhile
            pass
    return found


def test_a_one_node_run_listens_on_loopback_only(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    for key in ("WORLD_SIZE", "GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    run = tmp_path / "run"
    proc = prefork.popen([sys.executable, "-m", "megappo.cli", "train", "recipes/demo-cpu.yaml",
                             "logging.progress_bar=false", "run.val_before_train=false", "run.val_every=0",
                             "run.total_steps=3", "data.train_batch_size=16", "actor.ppo_mini_batch_size=16",
                             "critic.ppo_mini_batch_size=16", "actor.micro_batch_size=16", "critic.micro_batch_size=16",
                             f"run.output_dir={run}"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    watched, sockets, ranks_seen = psutil.Process(proc.pid), set(), set()
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        found = listening(watched)
        sockets |= found
        ranks_seen |= {pid for _, _, pid in found if pid != proc.pid}
        time.sleep(0.2)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, out[-4000:]
    assert (run / "metrics.jsonl").read_text().count("\n") == 3
    addresses = sorted({ip for ip, _, _ in sockets})
    print("listening on:", addresses, len(sockets), "sockets")
    assert len(ranks_seen) >= 2 and any(pid == proc.pid for _, _, pid in sockets), sockets  # stores and gloo were seen
    assert all(ipaddress.ip_address(ip).is_loopback for ip in addresses), addresses
