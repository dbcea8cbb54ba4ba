"""Reading a checkpoint runs no code from it (megappo.models.safe_pickle): a `.metadata`, a
`common.pt` or a byte item whose pickle calls os.system is refused with one line naming the
file, and the command never runs; real torch metadata still loads."""

import io
import os
import pickle
import uuid

import pytest
import torch

from megappo.models.safe_pickle import (UntrustedCheckpointError, _strategies, restricted_load,
                                        weights_only_load)


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def marker(tmp_path):
    path = f"/tmp/pwned_{uuid.uuid4().hex}"
    yield path
    assert not os.path.exists(path), "the checkpoint's code ran"


def test_metadata_that_calls_os_system_is_refused_and_runs_nothing(tmp_path, marker):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UntrustedCheckpointError) as e:
        restricted_load(str(path))
    assert str(e.value) == (f"refusing to unpickle posix.system from {path}: not a type a checkpoint holds; the "
                            "file was not written by megappo/torch, or was altered")


def test_getattr_and_eval_tricks_are_refused(tmp_path):
    for module, name in (("builtins", "getattr"), ("builtins", "eval"), ("torch", "load"), ("torch", "Tensor")):
        path = tmp_path / "m"
        path.write_bytes(f"c{module}\n{name}\n.".encode())  # protocol 0: GLOBAL module name
        with pytest.raises(UntrustedCheckpointError, match=f"refusing to unpickle {module}.{name} from "):
            restricted_load(str(path))


def test_real_torch_metadata_loads_the_same(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16), "obj": {"step": 3}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    with open(tmp_path / ".metadata", "rb") as f:
        expected = pickle.load(f)
    got = restricted_load(str(tmp_path / ".metadata"))
    assert got == expected
    assert got.state_dict_metadata["b"].properties.dtype == torch.bfloat16


def test_torch_load_of_a_code_pickle_is_refused_with_the_file(tmp_path, marker):
    path = tmp_path / "common.pt"
    torch.save({"optimizer": Payload(marker)}, path)
    with pytest.raises(UntrustedCheckpointError, match=f"refusing to unpickle posix.system from {path}: "):
        weights_only_load(str(path), str(path))
    buf = io.BytesIO(path.read_bytes())  # a byte item inside a .distcp is read from memory the same way
    with pytest.raises(UntrustedCheckpointError, match="refusing to unpickle posix.system from item x: "):
        weights_only_load(buf, "item x")


def test_megatron_strategies_refuse_and_restore_megatron(tmp_path, marker):
    from megatron.core.dist_checkpointing.strategies import torch as mtorch

    before = mtorch._get_filesystem_reader, mtorch.MCoreLoadPlanner
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    torch.save({"x": Payload(marker)}, tmp_path / "common.pt")
    sharded, common = _strategies()
    with pytest.raises(UntrustedCheckpointError, match=r"posix.system from .*\.metadata"):
        sharded.load_tensors_metadata(tmp_path)
    with pytest.raises(UntrustedCheckpointError, match=r"posix.system from .*common.pt"):
        common.load_common(str(tmp_path))
    assert (mtorch._get_filesystem_reader, mtorch.MCoreLoadPlanner) == before
