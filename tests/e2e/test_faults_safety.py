"""Safety faults through the CLI on one demo run (1 rank, fp32, 2 steps, a checkpoint at step 2):

- two `megappo train` on one run.output_dir started together: the second exits 2 with one line
  naming the first's PID, host and start time before writing anything; the first finishes with
  nothing of it deleted, and resumes;
- a checkpoint whose `.metadata` pickle calls os.system: `megappo train` (resume) and
  `megappo export` refuse it with one line naming the file (exit 2), and the command never runs; so does
  `megappo train` for such a byte item inside a `.distcp` shard (naming the shard and the item).
"""

import dataclasses
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
import uuid

import pytest
import torch

from megappo.trainer.checkpointing import file_digest

from tests import prefork
from tests.e2e._runs import metrics

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = ["parallel.tp=1", "hardware.gpus_per_node=1", "run.total_steps=2", "checkpoint.save_every=2",
        "run.val_before_train=false", "logging.progress_bar=false"]


def train(out, *extra):
    return [sys.executable, "-m", "megappo.cli", "train", "recipes/demo-cpu.yaml", f"run.output_dir={out}", *ARGS,
            *extra]


def env():
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    for k in ("WORLD_SIZE", "RANK", "MEGAPPO_RUN_LOCK"):
        e.pop(k, None)
    return e


def run(cmd, timeout=300):
    proc = prefork.run(cmd, env=env(), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def raced(tmp_path_factory):
    """Run A, and run B on the same directory started as soon as A holds it: (A's dir, B's exit code, B's output,
    A's files when B had ended)."""
    out = tmp_path_factory.mktemp("raced") / "run"
    first = prefork.popen(train(out), env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True)
    deadline = time.time() + 120
    while not os.path.exists(out / "megappo.lock") and first.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    code, said = run(train(out))
    files_then = {os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs}
    first_out = first.communicate(timeout=300)[0]
    assert first.returncode == 0, first_out[-4000:]
    return out, code, said, files_then


def test_second_run_on_a_directory_is_refused_and_the_first_is_untouched(raced):
    out, code, said, files_then = raced
    lines = [line for line in said.splitlines() if line.startswith("megappo: error:")]
    assert code == 2, said[-3000:]
    assert len(lines) == 1 and f"{out} is in use by another megappo run (PID " in lines[0]
    assert lines[0].endswith("Fix: wait for that run to end, or choose another run.output_dir."), lines[0]
    assert "Traceback" not in said
    files_now = {os.path.relpath(os.path.join(d, f), out) for d, _, fs in os.walk(out) for f in fs}
    assert {f for f in files_then if ".partial" not in f and not f.endswith("megappo.lock")} <= files_now  # nothing deleted
    assert [r["step"] for r in metrics(out)] == [1, 2]
    assert os.path.isdir(out / "checkpoints" / "step_00000002") and not os.path.exists(out / "megappo.lock")


def test_the_first_run_resumes(raced, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(raced[0], out)
    code, said = run(train(out, "run.total_steps=3"))
    assert code == 0, said[-4000:]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3]
    assert metrics(out)[:2] == metrics(raced[0])  # the first run's history is kept as it was
    assert os.path.isdir(out / "checkpoints" / "step_00000003")


class _Payload:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture
def poisoned(raced, tmp_path):
    """A copy of the run whose actor `.metadata` runs `touch MARKER` when unpickled; (dir, file, marker)."""
    out = tmp_path / "run"
    shutil.copytree(raced[0], out)
    marker = f"/tmp/pwned_{uuid.uuid4().hex}"
    meta = out / "checkpoints" / "step_00000002" / "actor" / ".metadata"
    meta.write_bytes(pickle.dumps(_Payload(f"touch {marker}")))
    # whoever can write the checkpoint can rewrite its digests too (they catch accidents, not attacks):
    # record the poisoned file's, so that loading reaches the unpickler
    manifest = out / "checkpoints" / "step_00000002" / "digests" / "rank_00000.json"
    record = json.loads(manifest.read_text())
    record["files"]["actor/.metadata"] = {"size": meta.stat().st_size, "digest": file_digest(str(meta))}
    manifest.write_text(json.dumps(record))
    yield out, meta, marker
    if os.path.exists(marker):
        os.unlink(marker)


def _refused(code, said, meta, marker):
    assert not os.path.exists(marker), "the checkpoint's code ran"
    assert code == 2, said[-4000:]
    lines = [line for line in said.splitlines() if line.startswith("megappo: error:")]
    assert lines == [f"megappo: error: refusing to unpickle posix.system from {meta}: not a type a checkpoint holds; "
                     "the file was not written by megappo/torch, or was altered"], said[-3000:]


def test_resume_from_a_poisoned_checkpoint_runs_nothing(poisoned):
    out, meta, marker = poisoned
    code, said = run(train(out, "run.total_steps=3"))
    _refused(code, said, meta, marker)
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_a_poisoned_byte_item_inside_a_shard_is_refused(raced, tmp_path):
    """A byte item of a `.distcp` shard (a layer's `_extra_state`, which torch pickles) replaced by one whose pickle
    calls os.system, its `.metadata` entry and the digests rewritten to match: the restricted planner refuses it
    inside torch's load (megappo.models.safe_pickle.SafeLoadPlanner.load_bytes) and load_dist_checkpoint turns
    torch's wrapped error into the one line, naming the shard file and the item."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    out = tmp_path / "run"
    shutil.copytree(raced[0], out)
    marker = f"/tmp/pwned_{uuid.uuid4().hex}"
    step = out / "checkpoints" / "step_00000002"
    meta_path = step / "actor" / ".metadata"
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)  # torch's own, as the run wrote it
    index, info = next((i, s) for i, s in sorted(meta.storage_data.items(), key=lambda kv: kv[0].fqn)
                       if isinstance(meta.state_dict_metadata[i.fqn], BytesStorageMetadata))
    shard = step / "actor" / info.relative_path
    blob = io.BytesIO()
    torch.save({"extra": _Payload(f"touch {marker}")}, blob)
    offset = shard.stat().st_size
    with open(shard, "ab") as f:  # the item now points at the payload, appended to its shard
        f.write(blob.getvalue())
    meta.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(blob.getvalue()))
    meta_path.write_bytes(pickle.dumps(meta))
    for manifest in (step / "digests").glob("rank_*.json"):  # as the poisoned fixture above: digests are no defence
        record = json.loads(manifest.read_text())
        for path in (meta_path, shard):
            name = str(path.relative_to(step))
            if name in record["files"]:
                record["files"][name] = {"size": path.stat().st_size, "digest": file_digest(str(path))}
        manifest.write_text(json.dumps(record))
    try:
        code, said = run(train(out, "run.total_steps=3"))
        _refused(code, said, f"{shard} (item {index.fqn})", marker)
    finally:
        if os.path.exists(marker):
            os.unlink(marker)
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_export_of_a_poisoned_checkpoint_runs_nothing(poisoned, tmp_path):
    out, meta, marker = poisoned
    code, said = run([sys.executable, "-m", "megappo.cli", "export", str(out), str(tmp_path / "hf")])
    _refused(code, said, meta, marker)
    assert not os.path.exists(tmp_path / "hf")
