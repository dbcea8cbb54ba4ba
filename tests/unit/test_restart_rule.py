"""Which failures of a launched run restart it (megappo.parallel.launch, run.max_restarts), and
the supervisor loop around torchrun, with torchrun's attempts replaced by recorded outcomes.
The real thing, a rank killed with SIGKILL and restarted, is tests/e2e/test_rank_death.py."""

import dataclasses
import os
import signal
import types

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from megappo.parallel import launch


def child_failed(*exitcodes):
    failures = {rank: ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="/nonexistent")
                for rank, code in enumerate(exitcodes)}
    for rank, failure in failures.items():
        failure.timestamp = rank  # rank 0 ended first
    return ChildFailedError("megappo", failures)


NO_SIGNAL = types.SimpleNamespace(stopped_at_once=False, exit_code=None)


@pytest.mark.parametrize("exitcodes, expected", [
    ((-15, -signal.SIGKILL), (1, (1, -9))),  # rank 1 killed with SIGKILL, torchrun stopped rank 0: restart
    ((launch.GAVE_UP_EXIT, -signal.SIGSEGV), (1, (1, -11))),  # a crash; rank 0 gave up on its collective
    ((launch.GAVE_UP_EXIT, -15), (3, (0, 3))),  # a collective timed out (a hung rank, stopped by torchrun)
    ((1, -15), (1, None)),  # a rank's own failure (a NaN abort, a failed weight sync, a bug)
    ((2, 2), (2, None)),  # bad input
    ((launch.USER_CODE_EXIT, -15), (4, None)),  # the user's code failed (its rank said so): no restart, no line
    ((launch.USER_CODE_EXIT, launch.USER_CODE_EXIT), (4, None)),  # ... and the other rank exited quietly with it
    ((130, 130), (130, None)),  # stopped on SIGINT sent to the ranks
    ((143, -15), (143, None)),  # stopped on SIGTERM
])
def test_restart_rule(exitcodes, expected, capsys):
    assert launch._failed(child_failed(*exitcodes), NO_SIGNAL) == expected
    printed = capsys.readouterr().err
    assert ("the other ranks were stopped" in printed) == (expected[1] is None and expected[0] not in (130, 143, 4))


def test_ray_driver_adds_no_line_after_an_error_in_the_users_code(capsys):
    from megappo.parallel.ray_launch import _exit_code

    shown = launch.RankError("reward function 'f' raised ValueError: x. Fix: correct that code", 4, True, 2.0)
    assert _exit_code({1: (launch.USER_CODE_EXIT, 2.0, shown), 0: (-15, 1.0, None)}, []) == launch.USER_CODE_EXIT
    assert capsys.readouterr().err == ""
    assert _exit_code({1: (1, 2.0, None), 0: (-15, 1.0, None)}, []) == 1
    assert "megappo: rank 1 failed (exited with code 1)" in capsys.readouterr().err


BUG = launch.RankError("ImportError: logging.sinks wandb needs the wandb package: pip install wandb", 1, False, 10.0)
REPORTED = launch.RankError("the tokenizer has 19 tokens but the model's vocab_size is 16. Fix: ...", 2, True, 10.0)


@pytest.mark.parametrize("ended, expected", [
    # rank 0's bug: it was still ending (its traceback) when rank 1 lost it and exited first; torchrun stopped rank 0
    ({0: (-15, 12.0, BUG), 1: (launch.GAVE_UP_EXIT, 11.0, None)},
     (0, 1, "megappo: error: rank 0 failed (exited with code 1); the other ranks were stopped. Its error: "
            "ImportError: logging.sinks wandb needs the wandb package: pip install wandb")),
    # bad input that rank 1 printed, rank 0 silent (it read the note): the rank's line is the last error already
    ({1: (2, 11.0, REPORTED), 0: (2, 12.0, None)},
     (1, 2, "megappo: rank 1 failed (exited with code 2); the other ranks were stopped.")),
    # ... but a survivor that could not read the note said it lost the rank: the error is repeated last
    ({1: (2, 11.0, REPORTED), 0: (launch.GAVE_UP_EXIT, 12.0, None)},
     (1, 2, "megappo: error: rank 1 failed (exited with code 2); the other ranks were stopped. Its error: "
            "the tokenizer has 19 tokens but the model's vocab_size is 16. Fix: ...")),
    # two ranks' own errors: the first recorded is the cause, whatever the exit order
    ({0: (2, 11.5, dataclasses.replace(REPORTED, time=11.5)), 1: (1, 12.0, dataclasses.replace(BUG, time=11.0))},
     (1, 1, "megappo: error: rank 1 failed (exited with code 1); the other ranks were stopped. Its error: "
            "ImportError: logging.sinks wandb needs the wandb package: pip install wandb")),
    # the user's code failed and nobody spoke after: no line; nothing recorded: as before (a signal first)
    ({0: (launch.USER_CODE_EXIT, 1.0, dataclasses.replace(REPORTED, exit_code=4)), 1: (-15, 2.0, None)},
     (0, 4, None)),
    ({0: (launch.GAVE_UP_EXIT, 1.0, None), 1: (-9, 2.0, None)},
     (1, -9, "megappo: rank 1 failed (was ended by signal SIGKILL); the other ranks were stopped.")),
])
def test_the_first_rank_to_record_its_own_error_is_named_last(ended, expected):
    """megappo.parallel.launch.cause / final_line, shared by torchrun's launcher and the Ray driver."""
    rank, code, error = launch.cause(ended)
    assert (rank, code, launch.final_line(rank, code, error, ended)) == expected


def test_a_recorded_error_is_read_back_as_torchrun_reads_it(tmp_path, monkeypatch):
    """record_error writes the file torchrun names in $TORCHELASTIC_ERROR_FILE; torchrun's own
    ProcessFailure parses it (its message, its time in seconds) and rank_error finds megappo's record."""
    path = tmp_path / "error.json"
    monkeypatch.setenv(launch.ERROR_FILE_ENV, str(path))
    launch.record_error("ValueError: boom", 1, shown=False)
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(path))
    error = launch.rank_error(failure.error_file_data)
    assert (error.message, error.exit_code, error.shown) == ("ValueError: boom", 1, False)
    assert failure.message["message"] == "ValueError: boom" and failure.timestamp == int(error.time)
    code, chosen = launch._failed(ChildFailedError("megappo", {0: failure}), NO_SIGNAL)
    assert (code, chosen) == (1, None)
    monkeypatch.delenv(launch.ERROR_FILE_ENV)
    launch.record_error("not written", 2, shown=True)  # outside torchrun: nowhere to write, no error


def test_no_restart_after_a_signal_to_the_launcher():
    """Ctrl-C at the launcher: the ranks it stopped do not restart, whatever their exit."""
    interrupted = types.SimpleNamespace(stopped_at_once=False, exit_code=130)
    assert launch._failed(child_failed(-signal.SIGINT, -signal.SIGINT), interrupted) == (130, None)
    twice = types.SimpleNamespace(stopped_at_once=True, exit_code=130)
    assert launch._failed(child_failed(-signal.SIGKILL, -signal.SIGKILL), twice) == (130, None)


def test_restart_loop_appends_restart_args_once_and_reports_each_restart(monkeypatch, capsys):
    outcomes = iter([(1, (1, -9)), (3, (0, launch.GAVE_UP_EXIT)), (0, None)])
    seen = []
    monkeypatch.setattr(launch, "_attempt", lambda argv, *how: (seen.append(argv), next(outcomes))[1])
    restarts = []
    code = launch.torchrun(["-m", "x"], max_restarts=2, restart_args=("checkpoint.resume=auto",),
                           on_restart=restarts.append)
    assert code == 0
    assert seen == [["-m", "x"], ["-m", "x", "checkpoint.resume=auto"], ["-m", "x", "checkpoint.resume=auto"]]
    assert [(r.restart, r.max_restarts, r.rank, r.exitcode, r.signal) for r in restarts] == [
        (1, 2, 1, -9, "SIGKILL"), (2, 2, 0, 3, None)]
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "megappo: rank 1 failed (was ended by signal SIGKILL); the other ranks were stopped; restart 1 of 2: every "
        "rank starts again from the latest checkpoint.",
        "megappo: rank 0 failed (exited with code 3); the other ranks were stopped; restart 2 of 2: every rank "
        "starts again from the latest checkpoint."]


def test_restart_loop_gives_up_after_max_restarts(monkeypatch, capsys):
    monkeypatch.setattr(launch, "_attempt", lambda argv, *how: (1, (1, -9)))
    restarts = []
    assert launch.torchrun(["-m", "x"], max_restarts=1, on_restart=restarts.append) == 1
    assert len(restarts) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "megappo: rank 1 failed (was ended by signal SIGKILL); the other ranks were stopped after 1 restart.")


def test_restart_loop_never_restarts_a_run_that_may_not(monkeypatch):
    monkeypatch.setattr(launch, "_attempt", lambda argv, *how: (2, None))
    restarts = []
    assert launch.torchrun(["-m", "x"], max_restarts=5, on_restart=restarts.append) == 2
    assert restarts == []


def test_a_failing_rank_leaves_a_note_the_others_read_in_the_store(tmp_path, capsys):
    """megappo.parallel.stage: the note a rank that reported its own error leaves (rank, exit code),
    read back through the process group's store; none before it is left. megappo.cli: a rank whose
    collective lost its peer says so (exit 3) without the note, and with it exits with the peer's
    code and says nothing."""
    import torch.distributed as dist

    from megappo.cli import run_reporting_errors
    from megappo.parallel import stage

    def lost_peer():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:10147")

    assert stage.peer_failure() is None  # no process group: nothing to read, no error
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert stage.peer_failure() is None
        assert run_reporting_errors(lost_peer) == launch.GAVE_UP_EXIT
        assert "lost its connection to another rank" in capsys.readouterr().err
        stage.tell_peers(launch.USER_CODE_EXIT)
        assert stage.peer_failure() == (0, launch.USER_CODE_EXIT)
        assert run_reporting_errors(lost_peer) == launch.USER_CODE_EXIT
        assert capsys.readouterr().err == ""
    finally:
        dist.destroy_process_group()


def test_a_ray_rank_hands_its_recorded_error_to_the_driver(tmp_path):
    """The Ray driver's rank wrapper (megappo.parallel.ray_launch._Rank, here without Ray) gives its child
    its own error file and returns what the child recorded with its exit code: a rank refusing a recipe
    that does not exist (bad input, exit 2, printed by the rank)."""
    import time

    from megappo.parallel.ray_launch import _Rank

    rank = _Rank()
    rank.start(["train", str(tmp_path / "missing.yaml")], {"RANK": "0", "WORLD_SIZE": "1"}, str(tmp_path))
    lines, deadline = [], time.monotonic() + 120
    while True:
        new, code, error = rank.poll()
        lines += new
        if code is not None or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert code == 2, lines
    assert error.exit_code == 2 and error.shown and error.message in "".join(lines)
    assert "missing.yaml" in error.message and not os.path.exists(os.path.dirname(rank.error_file))
