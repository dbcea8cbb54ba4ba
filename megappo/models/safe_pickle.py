"""Reading a checkpoint never runs code from it: what is trusted and how it is enforced.

A Megatron dist-checkpoint directory holds pickles in three places, and a stock
`dist_checkpointing.load` would unpickle them as follows (Megatron-Core 0.16.1, torch 2.13):

| file | read by | stock | here |
|---|---|---|---|
| `.metadata` | torch `FileSystemReader.read_metadata` | `pickle.load`: any object | `RestrictedUnpickler`: only `TRUSTED` |
| byte items inside `__R_N.distcp` (Megatron's `ShardedObject`s, e.g. `_extra_state`) | torch `DefaultLoadPlanner.load_bytes` | `torch.load(weights_only=False)` | `torch.load(weights_only=True)` |
| `common.pt` (optimizer param groups, LR scheduler) | Megatron `TorchCommonLoadStrategy.load_common` | `torch.load` (weights_only by default) | `torch.load(weights_only=True)`, passed explicitly |

`metadata.json` (Megatron's strategy names) and `megappo_model.json` are JSON; tensors are
raw storage bytes read into pre-allocated tensors. `load_dist_checkpoint` is the one entry
point megappo uses (resume on every rank, `megappo export`, tools/convert_megatron_to_hf.py,
the smoke test, a role's starting weights from a Megatron checkpoint; `dist_checkpoint_contents`
lists what such a checkpoint holds before it loads): it hands Megatron a sharded load strategy and a common load strategy of its
own. Megatron's strategy builds its `FileSystemReader` and `MCoreLoadPlanner` inside
`load()` from module globals, so `SafeTorchDistLoadStrategy` swaps those two globals of
`megatron.core.dist_checkpointing.strategies.torch` for the restricted ones for the duration
of its own call and restores them after (no other thread loads a checkpoint meanwhile);
torch itself is not patched.

`TRUSTED` was derived by recording every global that the `.metadata` of real megappo
checkpoints names (the CPU demo's actor and critic, fp32 and bf16, plain and distributed
optimizer), then adding the sibling record types of the same torch modules that other
layouts write (`ReadItem`, `LoadItemType`, `BytesIOWriteData`, ...), torch's dtypes, layouts
and memory formats, pathlib paths (torch records the checkpoint_id it was saved to), and
builtin containers. Nothing in it runs code when constructed.

This module does not know about trainer checkpoints, models or PPO.
"""

from __future__ import annotations

import contextlib
import io
import pickle
import re

import torch

from megappo.models.hf_config import ModelConfigError

_DCP = "torch.distributed.checkpoint"

#: module -> names a checkpoint's `.metadata` may name (classes are constructed, functions called)
TRUSTED: dict[str, frozenset[str]] = {
    f"{_DCP}.metadata": frozenset({"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                   "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                                   "_MEM_FORMAT_ENCODING"}),
    f"{_DCP}.planner": frozenset({"SavePlan", "LoadPlan", "WriteItem", "ReadItem", "WriteItemType", "LoadItemType",
                                  "TensorWriteData", "BytesIOWriteData"}),
    f"{_DCP}.filesystem": frozenset({"_StorageInfo"}),
    "torch": frozenset({"Size"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout's name -> torch's layout object, or KeyError
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),  # StorageMeta.checkpoint_id
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "bool", "str",
                           "bytes", "bytearray", "slice"}),
}


def _torch_constant(module: str, name: str) -> bool:
    """torch.float32, torch.strided, torch.contiguous_format: values, not callables."""
    return module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                         torch.memory_format))


class UntrustedCheckpointError(ModelConfigError):
    """A checkpoint file names something that a checkpoint written by megappo/torch never holds."""


def refusal(what: str, path: str) -> UntrustedCheckpointError:
    return UntrustedCheckpointError(f"refusing to unpickle {what} from {path}: not a type a checkpoint holds; the "
                                    "file was not written by megappo/torch, or was altered")


class RestrictedUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that resolves only the globals in `TRUSTED` (and torch dtypes/layouts/
    memory formats); any other global raises `UntrustedCheckpointError` before it is looked up."""

    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if name in TRUSTED.get(module, ()) or _torch_constant(module, name):
            return super().find_class(module, name)
        raise refusal(f"{module}.{name}", self.path)


def restricted_load(path: str):
    """The object pickled in `path`, through `RestrictedUnpickler`."""
    with open(path, "rb") as f:
        return RestrictedUnpickler(f, path).load()


def weights_only_load(source, path: str, **kwargs):
    """`torch.load(source, weights_only=True)`; a global outside torch's allow-list is refused
    with `UntrustedCheckpointError` naming `path` (torch's own message is a paragraph)."""
    try:
        return torch.load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e)) or re.search(r"global:? ([\w.]+)", str(e))
        raise refusal(found.group(1) if found else "an object", path) from None


def _safe_reader_class():
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import \
        CachedMetadataFileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(CachedMetadataFileSystemReader):
        """Megatron's metadata-caching reader whose `.metadata` goes through `RestrictedUnpickler`."""

        def read_metadata(self, *args, **kwargs):
            if self._cached_metadata is None:
                path = str(self._get_metadata_path(kwargs.get("rank")))
                with self.fs.create_stream(path, "rb") as f:
                    metadata = RestrictedUnpickler(f, path).load()
                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
                self._cached_metadata = metadata
            return self._cached_metadata

    return SafeFileSystemReader


def _safe_planner_class(checkpoint_dir: str):
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(MCoreLoadPlanner):
        """Megatron's load planner whose byte items are read with weights_only=True."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
            shard = f"{checkpoint_dir}/{info.relative_path}" if info is not None else checkpoint_dir
            obj = weights_only_load(value, f"{shard} (item {read_item.dest_index.fqn})")
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner


@contextlib.contextmanager
def _restricted_megatron_reads(checkpoint_dir: str):
    from megatron.core.dist_checkpointing.strategies import torch as mtorch

    reader = _safe_reader_class()
    saved = mtorch._get_filesystem_reader, mtorch.MCoreLoadPlanner
    mtorch._get_filesystem_reader = lambda path, cache_metadata=False: reader(path)
    mtorch.MCoreLoadPlanner = _safe_planner_class(str(checkpoint_dir))
    try:
        yield
    finally:
        mtorch._get_filesystem_reader, mtorch.MCoreLoadPlanner = saved


def _strategies():
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    class SafeTorchDistLoadStrategy(TorchDistLoadShardedStrategy):
        def load(self, sharded_state_dict, checkpoint_dir):
            with _restricted_megatron_reads(checkpoint_dir):
                return super().load(sharded_state_dict, checkpoint_dir)

        def load_tensors_metadata(self, checkpoint_dir, metadata=None):
            with _restricted_megatron_reads(checkpoint_dir):
                return super().load_tensors_metadata(checkpoint_dir, metadata)

        def load_sharded_metadata(self, checkpoint_dir):
            with _restricted_megatron_reads(checkpoint_dir):
                return super().load_sharded_metadata(checkpoint_dir)

    class SafeCommonLoadStrategy(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            import os

            from megatron.core.dist_checkpointing.core import CheckpointingException
            from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME

            path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
            if not os.path.isfile(path):
                raise CheckpointingException(f"Common file {path} does not exist")
            return weights_only_load(path, path, map_location="cpu")

    return SafeTorchDistLoadStrategy(), SafeCommonLoadStrategy()


def load_dist_checkpoint(sharded_state_dict: dict, checkpoint_dir: str) -> dict:
    """Collective: Megatron's `dist_checkpointing.load`, with every pickle read restricted as above."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    import os

    metadata = os.path.join(checkpoint_dir, ".metadata")
    if os.path.isfile(metadata):
        restricted_load(metadata)  # refused here in one line: torch's planner wraps its readers' errors
    sharded, common = _strategies()
    try:
        return dist_checkpointing.load(sharded_state_dict, checkpoint_dir, sharded_strategy=sharded,
                                       common_strategy=common)
    except CheckpointException as e:  # a byte item refused inside torch's planner: torch wraps it per rank
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, UntrustedCheckpointError)]
        if refused:
            raise UntrustedCheckpointError(str(refused[0])) from None
        raise


def dist_checkpoint_contents(checkpoint_dir: str) -> dict:
    """Megatron's `load_sharded_metadata`: key -> ShardedTensor (global shape, no data) or ShardedObject, every
    pickle read restricted as above."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    import os

    metadata = os.path.join(checkpoint_dir, ".metadata")
    if os.path.isfile(metadata):
        restricted_load(metadata)
    sharded, common = _strategies()
    return load_sharded_metadata(checkpoint_dir, sharded_strategy=sharded, common_strategy=common)
