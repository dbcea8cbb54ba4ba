"""A rollout engine child that dies mid-handshake leaves no stray traceback: multiprocessing's
resource_sharer thread reports a lost fd handshake through sys.excepthook, which megappo.rollout.hf.remote
silences for that thread's connection errors only (the death is reported by EngineCrashed)."""

import sys

from megappo.rollout.hf import remote


def _raise_in(filename: str, exc: BaseException):
    try:
        exec(compile("raise exc", filename, "exec"), {"exc": exc})
    except BaseException:  # noqa: BLE001 - handed to the hook as multiprocessing does
        return sys.exc_info()


def test_lost_fd_handshakes_are_quiet_and_nothing_else_is(monkeypatch, capsys):
    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda *info: printed.append(info[0]))
    remote._quiet_lost_handshakes()
    remote._quiet_lost_handshakes()  # once per process: the hook is not stacked
    sharer = "/usr/lib/python3.11/multiprocessing/resource_sharer.py"
    sys.excepthook(*_raise_in(sharer, ConnectionResetError(104, "Connection reset by peer")))
    sys.excepthook(*_raise_in(sharer, EOFError()))
    assert printed == []
    sys.excepthook(*_raise_in(sharer, ValueError("a bug")))  # not a lost connection
    sys.excepthook(*_raise_in("/work/train.py", ConnectionResetError(104, "reset")))  # not the sharer's
    assert printed == [ValueError, ConnectionResetError]
