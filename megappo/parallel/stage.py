"""Stage labels for collectives, and the error a timed-out or broken collective becomes.

`with stage("update_actor"):` records what this rank is doing. When a collective inside fails
because it waited longer than the process group's timeout (parallel.timeout_minutes) or because
another rank's connection dropped, torch.distributed raises a RuntimeError whose text is the
backend's ("Timed out waiting 1800000ms for recv operation", "Connection reset by peer"); `stage`
turns it into a `CollectiveError` that names this rank, its place in the layout, the stage and
what to look at, e.g.

    rank 1 (tp_rank 1, pp_rank 0, dp_rank 0) timed out after 30 min in stage 'update_actor'
    waiting for a collective; another rank probably crashed or hangs: check its log. ...

Which rank this is and the timeout are recorded once by `init_parallel` (`set_identity`): they
only word the message and change no behaviour. Other exceptions pass through unchanged.
Measured with gloo (torch 2.13): a collective whose peer sleeps raises after the timeout; one
whose peer died raises at once with "Connection reset by peer". With NCCL a timed-out
collective is usually reported by NCCL's watchdog, which ends the process itself.

A rank that ends on an error it has reported (megappo.cli) first leaves a note in the process
group's store (`tell_peers(exit_code)`); a rank whose collective then loses that peer finds it
(`peer_failure()`) and exits with the same code without a message of its own, so the one error
stays the last thing on the screen. Under torchrun (megappo's launcher, SLURM) the store is the
launching agent's and outlives the failed rank; where rank 0 holds the store itself (the Ray
launcher, a world of one) and rank 0 failed, the note cannot be read and the peers say what
they saw, as before.

A rank that dies without a word (SIGKILL, a crash, its node lost) leaves no note, nor does one
that hangs (the others time out). Each rank records its node and PID in the store at start-up
and reads every rank's (`set_identity`); when they span several nodes, the ranks that lose a
peer hold a roll call (`roll_call`): each answers, waits `ROLL_CALL_S` for the others, and the
ranks that neither answered nor left a note, nor are live processes of the caller's own node
(blocked in a collective with a survivor), are the lost ones; the lowest rank that answered
words the one line naming them by node (`lost_line`). A survivor of a third node blocked that
way would be named too. When the store itself is gone, it went with rank 0's node, which hosts
it. On one node the launcher already names the rank that failed, and no roll call is held.

This module does not know about models, configs or PPO.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Iterator

import torch.distributed as dist

_TIMEOUT_TEXT = ("timed out", "timeout")
_PEER_LOST_TEXT = ("connection reset by peer", "connection closed by peer", "broken pipe", "connection refused")

_stages: list[str] = []
_identity = {"where": "rank 0", "timeout": "the timeout"}


class CollectiveError(RuntimeError):
    """A collective timed out or lost a peer; the message names the rank and the stage."""

    def __init__(self, stage_name: str, message: str):
        super().__init__(message)
        self.stage_name = stage_name


def set_identity(rank: int, tp_rank: int, pp_rank: int, dp_rank: int, timeout_minutes: float,
                 node: str | None = None) -> None:
    """Called by init_parallel: how this rank and the timeout are named in a CollectiveError;
    `node` (default `node_name()`) is recorded in the store for a roll call."""
    _identity["where"] = f"rank {rank} (tp_rank {tp_rank}, pp_rank {pp_rank}, dp_rank {dp_rank})"
    _identity["timeout"] = (f"{timeout_minutes * 60:g} s" if timeout_minutes < 1 else f"{timeout_minutes:g} min")
    _identity.pop("nodes", None), _identity.pop("pids", None)
    try:
        store = _store()
        if store is not None:  # every rank's node, known before any can be lost (one round trip at start-up)
            store.set(f"{_NODE_KEY}{rank}", f"{os.getpid()} {node or node_name()}")
            keys = [f"{_NODE_KEY}{r}" for r in range(dist.get_world_size())]
            store.wait(keys)
            pids, nodes = zip(*(v.decode().split(" ", 1) for v in store.multi_get(keys)))
            _identity["nodes"], _identity["pids"] = list(nodes), [int(p) for p in pids]
    except Exception:  # no store to share it in: no roll call
        pass


def node_name() -> str:
    """This rank's node as a roll call names it: torchrun's node rank (GROUP_RANK) and the host."""
    group = os.environ.get("GROUP_RANK")
    return f"node {group} (host {socket.gethostname()})" if group is not None else f"host {socket.gethostname()}"


#: the store key of the note a failing rank leaves for the others: "RANK EXIT_CODE"
_FAILED_KEY = "megappo/failed_rank"
#: + rank: the rank's node (set_identity); the rank's answer to a roll call
_NODE_KEY, _ANSWER_KEY = "megappo/node/", "megappo/answered/"
#: how long a rank that lost a peer waits for the other survivors to answer the roll call
ROLL_CALL_S = 3.0


def _store():
    return dist.distributed_c10d._get_default_store() if dist.is_available() and dist.is_initialized() else None


def tell_peers(exit_code: int) -> None:
    """Leave the note that this rank ends on its own reported error (best effort: never raises)."""
    try:
        store = _store()
        if store is not None:
            store.set(_FAILED_KEY, f"{dist.get_rank()} {exit_code}")
            store.set(f"{_ANSWER_KEY}{dist.get_rank()}", "error")  # not lost: it said why it ends
    except Exception:  # the store is gone too: the peers report what they see
        pass


def peer_failure() -> tuple[int, int] | None:
    """(rank, exit code) of a rank that ended on its own reported error, when one left the note."""
    try:
        store = _store()
        if store is None or not store.check([_FAILED_KEY]):
            return None
        rank, code = store.get(_FAILED_KEY).decode().split()
        return int(rank), int(code)
    except Exception:  # the store went with the failed rank
        return None


def roll_call(wait_s: float = ROLL_CALL_S) -> tuple[dict[int, str], bool, bool] | None:
    """Called by a rank whose collective lost a peer, on a world that spans several nodes: answers,
    waits `wait_s` for the other survivors, and returns ({lost rank: its node}, whether this rank
    words the line: the lowest that answered, whether the store went too); None on one node or
    when nobody is missing. A store that went is taken to have gone with rank 0's node, which
    hosts it (torchrun's node 0, the Ray launcher's rank 0): the lowest rank of each other node
    words the line then (there is no store left to agree on one)."""
    nodes, store = _identity.get("nodes"), _store()
    if not nodes or store is None or not dist.is_initialized():
        return None
    return _roll_call(store, nodes, _identity["pids"], dist.get_rank(), wait_s)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _roll_call(store, nodes: list[str], pids: list[int], me: int, wait_s: float
               ) -> tuple[dict[int, str], bool, bool] | None:
    """roll_call's work. A rank of this rank's own node that did not answer (blocked in a collective
    with another survivor) but whose process is alive is not lost."""
    if len(set(nodes)) < 2:
        return None
    try:
        store.set(f"{_ANSWER_KEY}{me}", "lost a peer")
        time.sleep(wait_s)
        answered = [r for r in range(len(nodes)) if store.check([f"{_ANSWER_KEY}{r}"])]
    except Exception:  # the store is gone: with rank 0's node
        if nodes[me] == nodes[0]:
            return None
        lost = {r: node for r, node in enumerate(nodes) if node == nodes[0]}
        return lost, me == min(r for r, node in enumerate(nodes) if node == nodes[me]), True
    lost = {r: nodes[r] for r in range(len(nodes))
            if r not in answered and not (nodes[r] == nodes[me] and _alive(pids[r]))}
    return (lost, me == min(answered), False) if lost else None


def lost_line(lost: dict[int, str], stage_name: str, store_gone: bool = False) -> str:
    """The one line naming the lost ranks by node: `rank 0 (...) lost node 1 (host h): ranks 2, 3 in
    stage 'update_actor': they stopped answering ...`."""
    by_node: dict[str, list[int]] = {}
    for rank, node in sorted(lost.items()):
        by_node.setdefault(node, []).append(rank)
    parts = [f"{node}: rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}" for node, ranks in by_node.items()]
    store = " and the run's store, which that node hosted," if store_gone else ""
    return (f"{_identity['where']} lost {'; '.join(parts)}{store} in stage '{stage_name}': they stopped "
            "answering (killed, crashed, hung, or their node went down); the other ranks stopped. Fix: check that "
            "node, then rerun the same command: it resumes from the latest complete checkpoint.")


def current_stage() -> str:
    return _stages[-1] if _stages else "outside any named stage"


def as_collective_error(e: BaseException, stage_name: str | None = None) -> CollectiveError | None:
    """The CollectiveError that backend error `e` stands for; None when it is something else."""
    if isinstance(e, CollectiveError):
        return e
    text, where = str(e).lower(), _identity["where"]
    # gloo raises plain RuntimeErrors naming itself; NCCL and the store raise torch's DistErrors
    if not (isinstance(e, dist.DistError) or (isinstance(e, RuntimeError) and ("gloo" in text or "nccl" in text))):
        return None
    name = stage_name or current_stage()
    if any(t in text for t in _TIMEOUT_TEXT):
        return CollectiveError(name,
            f"{where} timed out after {_identity['timeout']} in stage '{name}' waiting for a collective; another "
            "rank probably crashed or hangs: check its log. Fix: if that stage is legitimately this slow, raise "
            f"parallel.timeout_minutes. (backend: {str(e).splitlines()[0][:200]})")
    if any(t in text for t in _PEER_LOST_TEXT):
        return CollectiveError(name,
            f"{where} lost its connection to another rank in stage '{name}' during a collective; that rank "
            "probably crashed: check its log (the launcher names the rank that failed first). "
            f"(backend: {str(e).splitlines()[0][:200]})")
    return None


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Label the collectives inside; a timed-out or broken one raises CollectiveError naming `name`."""
    _stages.append(name)
    try:
        yield
    except RuntimeError as e:
        error = as_collective_error(e, name)
        if error is None or error is e:
            raise
        raise error from e
    finally:
        _stages.pop()
