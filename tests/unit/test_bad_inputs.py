"""The bad-input catalogue (docs/bad-inputs.md), through `megappo train` itself.

Each case here is refused before any rank starts: `megappo.cli.main(["train", RECIPE, ...])`
in this process returns 2 after one `megappo: error: ...` line that says the fix, and the
run's output directory was never created. The cases that need ranks, the tokenizer or the
training loop (dataset rows, the vocabulary, non-finite losses, weight sync, collective
timeouts) are in tests/e2e/test_bad_inputs_cli.py. Also here: how a failed collective is
worded (megappo.parallel.stage) and the scan that keeps pickle loading out of megappo.
"""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from megappo import cli
from megappo.parallel import stage as stage_module
from megappo.parallel.stage import CollectiveError, stage

REPO = pathlib.Path(__file__).resolve().parents[2]
DEMO = str(REPO / "recipes" / "demo-cpu.yaml")
DEMO_MODEL = yaml.safe_load(open(DEMO))["model"]["hf_config"]  # 4 heads, 2 query groups, FFN 128, 2 layers, vocab 19
FILES = ["data.builtin=null", "run.val_before_train=false", "run.val_every=0"]  # train from data.train_files


def train(tmp_path, capsys, *args):
    """`megappo train` on the demo recipe; (exit code, stderr). The output dir must not appear."""
    out = tmp_path / "run"
    code = cli.main(["train", DEMO, f"run.output_dir={out}", *args])
    err = capsys.readouterr().err
    assert not out.exists(), f"{out} was created before the error: {err}"
    return code, err


def refused(tmp_path, capsys, *args) -> str:
    code, err = train(tmp_path, capsys, *args)
    assert code == 2 and err.startswith("megappo: error: ") and "Fix" in err, (code, err)
    return err


# (overrides, what the message must say); {tmp} is the test's directory
CASES = {
    "unknown key": (["parallel.tpp=2"], "unknown config key 'parallel.tpp'. Did you mean 'parallel.tp'? Fix"),
    "unknown section": (["paralel.tp=2"], "unknown config key 'paralel'. Did you mean 'parallel'?"),
    "wrong type": (["parallel.tp=two"], "parallel.tp: expected int, got 'two' (str). Fix: write e.g. parallel.tp=2"),
    "wrong choice": (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator: 'ppo' is not one of"),
    "not finite": (["actor.optim.lr=.inf"], "actor.optim.lr=inf is not a finite number"),
    "tp vs heads": (["parallel.tp=3", "--world-size", "3"],
                    "num_attention_heads=4 is not divisible by tp=3; num_key_value_heads=2 is not divisible by tp=3"),
    "tp vs query groups": (["parallel.tp=4"], "num_key_value_heads=2 is not divisible by tp=4. Fix: choose "
                                              "parallel.tp from [1, 2]"),
    "pp vs layers": (["parallel.tp=1", "parallel.pp=3"], "num_hidden_layers=2 is not divisible by pp=3"),
    "pp*vpp vs layers": (["parallel.tp=1", "parallel.pp=2", "parallel.vpp=2"],
                         "num_hidden_layers=2 is not divisible by pp*vpp=2*2"),
    "world vs tp*pp": (["--world-size", "3"], "world size 3 is not a multiple of parallel.tp*parallel.pp = 2*1. "
                                              "Fix: launch a multiple of 2 ranks"),
    "batch vs dp": (["--world-size", "4", "actor.packing=false"],
                    "actor: a mini-batch of 32 sequences does not split over dp=2 replicas in micro-batches of 32"),
    "budget vs length": (["critic.max_tokens_per_micro_batch=3"],
                         "critic.max_tokens_per_micro_batch=3 is smaller than the longest sequence"),
    "timeout": (["parallel.timeout_minutes=0"], "parallel.timeout_minutes=0.0 must be > 0"),
    "no data": (["data.builtin=null"], "data.train_files and data.builtin are both empty"),
    "missing dataset": ([*FILES, "data.train_files=[{tmp}/nope.jsonl]"],
                        "dataset file '{tmp}/nope.jsonl' (data.train_files) does not exist"),
    "empty dataset": ([*FILES, "data.train_files=[{tmp}/empty.jsonl]"],
                      "dataset file '{tmp}/empty.jsonl' (data.train_files) is empty (no rows)"),
    "dataset format": ([*FILES, "data.train_files=[{tmp}/rows.csv]"], "has an unsupported format"),
    "missing val dataset": (["run.val_before_train=true", "data.val_files=[{tmp}/nope.jsonl]"],
                            "(data.val_files) does not exist"),
    "no reward": (["reward.functions=[]"], "no reward: reward.functions is empty"),
    "unknown reward": (["reward.functions=[digit_sucessor]"], "Did you mean 'digit_successor'?"),
    "model dir": (["model.hf_config=null", "model.path={tmp}"], "no config.json in '{tmp}'"),
    "model to prepare": (["model.hf_config=null", "model.path={tmp}/assets/m", "model.prepare='python prep.py --x'"],
                         "model.path={tmp}/assets/m does not exist yet: this recipe's model is prepared once by a "
                         "command. Fix: run `python prep.py --x`, then start the run again."),
    "tokenizer": (["model.tokenizer={tmp}/tok"], "tokenizer directory '{tmp}/tok' does not exist"),
    "builtin tokenizer": (["model.tokenizer=builtin:words"], "unknown built-in tokenizer 'builtin:words'"),
    "critic vocab": (["critic.path={tmp}/critic"], "critic.path has vocab_size 32, the actor (model) 19"),
    "critic layout": (["critic.path={tmp}/critic3"], "critic.path as the critic: the parallel layout does not fit "
                                                     "the model: num_attention_heads=3 is not divisible by tp=2"),
    "role layout vs world": (["--world-size", "2", "critic.parallel.tp=4"],
                             "world size 2 is not a multiple of critic's tp*pp = 4*1"),
    "role layout vs model": (["parallel.tp=1", "critic.parallel.tp=2", "critic.path={tmp}/critic3",
                              "actor.micro_batch_size=16", "critic.micro_batch_size=16"],
                             "critic.path as the critic (its own layout: critic.parallel): the parallel layout does "
                             "not fit the model: num_attention_heads=3 is not divisible by tp=2"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refused_before_any_rank_starts(tmp_path, capsys, case):
    overrides, needle = CASES[case]
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "rows.csv").write_text("prompt\n1>\n")
    for name, changes in {"critic": {"vocab_size": 32}, "critic3": {"num_attention_heads": 3,
                                                                    "num_key_value_heads": 3}}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**DEMO_MODEL, **changes}))
    err = refused(tmp_path, capsys, *(o.replace("{tmp}", str(tmp_path)) for o in overrides))
    assert needle.replace("{tmp}", str(tmp_path)) in err


def test_recipe_file_errors(tmp_path, capsys):
    code = cli.main(["train", str(tmp_path / "missing.yaml")])
    assert code == 2 and "cannot read recipe" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: [unclosed\n")
    code = cli.main(["train", str(bad)])
    assert code == 2 and "is not valid YAML at line" in capsys.readouterr().err


# -- collectives: the message a timed-out or broken one becomes --------------------------------

GLOO_TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 1800000ms for recv"
GLOO_PEER_LOST = "[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer."


@pytest.fixture
def rank3(monkeypatch):
    monkeypatch.setattr(stage_module, "_identity", dict(stage_module._identity))
    stage_module.set_identity(rank=3, tp_rank=1, pp_rank=1, dp_rank=0, timeout_minutes=0.5)


def test_a_timed_out_collective_names_rank_layout_and_stage(rank3):
    with pytest.raises(CollectiveError) as e, stage("step"), stage("update_actor"):
        raise RuntimeError(GLOO_TIMEOUT)
    assert str(e.value).startswith("rank 3 (tp_rank 1, pp_rank 1, dp_rank 0) timed out after 30 s in stage "
                                   "'update_actor' waiting for a collective; another rank probably crashed or hangs: "
                                   "check its log. Fix: ")
    with pytest.raises(CollectiveError, match="rank 3 .* lost its connection to another rank in stage 'gen'"):
        with stage("gen"):
            raise RuntimeError(GLOO_PEER_LOST)
    with pytest.raises(RuntimeError, match="^shapes do not match$"):  # not a collective failure: unchanged
        with stage("gen"):
            raise RuntimeError("shapes do not match")
    assert stage_module.current_stage() == "outside any named stage"


def test_a_roll_call_names_the_ranks_of_a_lost_node(rank3):
    """Several nodes: the ranks that lose a peer answer a roll call in the store; the ranks that
    neither answered nor left an error note are named, by node, by the lowest rank that answered."""
    import torch.distributed as dist

    nodes = ["node 0 (host a)"] * 2 + ["node 1 (host b)"] * 2
    gone = subprocess.Popen([sys.executable, "-c", ""])
    gone.wait()
    pids = [gone.pid] * 4  # no such process
    store = dist.HashStore()
    store.set(f"{stage_module._ANSWER_KEY}0", "lost a peer")
    assert stage_module._roll_call(store, nodes, pids, 1, wait_s=0) == ({2: nodes[2], 3: nodes[3]}, False, False)
    assert stage_module._roll_call(store, nodes, pids, 0, wait_s=0)[1] is True  # the lowest that answered words it
    store.set(f"{stage_module._ANSWER_KEY}3", "error")  # rank 3 ended on its own reported error: not lost
    lost, _, _ = stage_module._roll_call(store, nodes, pids, 0, wait_s=0)
    assert stage_module.lost_line(lost, "update_actor").startswith(
        "rank 3 (tp_rank 1, pp_rank 1, dp_rank 0) lost node 1 (host b): rank 2 in stage 'update_actor': they stopped "
        "answering (killed, crashed, hung, or their node went down); the other ranks stopped. Fix: ")
    assert stage_module._roll_call(store, nodes[:1] * 4, pids, 0, wait_s=0) is None  # one node: the launcher says it
    # a rank of this rank's node that did not answer (blocked in a collective with a survivor) but is alive: not lost
    blocked = dist.HashStore()
    blocked.set(f"{stage_module._ANSWER_KEY}1", "lost a peer")
    assert stage_module._roll_call(blocked, nodes, [os.getpid(), *pids[1:]], 1, wait_s=0) == \
        ({2: nodes[2], 3: nodes[3]}, True, False)

    class Gone:  # the store went with the node that hosted it (rank 0's)
        def set(self, *a):
            raise dist.DistNetworkError("Connection reset by peer")

    assert stage_module._roll_call(Gone(), nodes, pids, 3, wait_s=0) == ({0: nodes[0], 1: nodes[1]}, False, True)
    assert stage_module._roll_call(Gone(), nodes, pids, 2, wait_s=0)[1] is True  # the lowest rank of its node words it
    assert "lost node 0 (host a): ranks 0, 1 and the run's store, which that node hosted, in stage 'gen'" in \
        stage_module.lost_line({0: nodes[0], 1: nodes[1]}, "gen", store_gone=True)


def test_cli_reports_run_failures_in_one_line(rank3, capsys):
    def fails(error):
        raise error

    assert cli.run_reporting_errors(fails, RuntimeError(GLOO_TIMEOUT)) == 3  # raised outside any stage
    assert capsys.readouterr().err.startswith("megappo: error: rank 3 (tp_rank 1, pp_rank 1, dp_rank 0) timed out "
                                              "after 30 s in stage 'outside any named stage'")
    with pytest.raises(RuntimeError, match="a bug"):  # anything else keeps its traceback
        cli.run_reporting_errors(fails, RuntimeError("a bug"))


def test_the_launcher_names_the_cause_not_the_first_exit():
    """Exit codes as torchrun reports them (a signal as its negative): a rank's own error, then
    a crash or OOM kill, then a rank that gave up waiting (3), then one torchrun stopped."""
    from megappo.parallel.launch import failure_rank_order

    assert sorted([-15, 3, -9, 2, 1], key=failure_rank_order) == [2, 1, -9, 3, -15]


# -- item 7: nothing megappo loads can run code --------------------------------------------------

def _calls(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            yield name, node.func.attr, {k.arg: k.value for k in node.keywords}, node.lineno


#: modules that unpickle what their own child process sends over a private pipe (never a file)
#: pickles between the run's own processes, never from a file: rank 0 and its engine child (a pipe), rank 0 and
#: the other rollout replicas' leaders (TCP, HMAC-authenticated with a key drawn per run and shared over the job's
#: process group)
PICKLE_PIPES = {REPO / "megappo/rollout/hf/remote.py", REPO / "megappo/rollout/replicas.py"}


def test_no_pickle_loading_in_megappo():
    """torch.load only with weights_only=True, no pickle / numpy-pickle loads, and HF models
    only from safetensors (or GGUF in tools/prepare_smollm2.py): a checkpoint or model
    directory from elsewhere cannot run code. (Megatron's own dist-checkpoint loading uses
    torch.load with torch's weights_only default and torch DCP's pickled .metadata: see docs/bad-inputs.md.)"""
    problems = []
    for path in sorted([*(REPO / "megappo").rglob("*.py"), *(REPO / "tools").rglob("*.py")]):
        for owner, attr, kw, line in _calls(path):
            where = f"{path.relative_to(REPO)}:{line}"
            true = lambda k: isinstance(kw.get(k), ast.Constant) and kw[k].value is True  # noqa: E731
            if owner == "torch" and attr == "load" and not true("weights_only"):
                problems.append(f"{where}: torch.load without weights_only=True")
            if owner in ("pickle", "cPickle", "dill") and attr in ("load", "loads") and path not in PICKLE_PIPES:
                problems.append(f"{where}: {owner}.{attr}")
            if owner in ("np", "numpy") and attr == "load" and "allow_pickle" in kw:
                problems.append(f"{where}: np.load with allow_pickle")
            if attr == "from_pretrained" and "Tokenizer" not in owner and not (true("use_safetensors")
                                                                                 or "gguf_file" in kw):
                problems.append(f"{where}: {owner}.from_pretrained without use_safetensors=True")
    assert not problems, problems
