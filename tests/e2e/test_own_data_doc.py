"""docs/own-data.md, run as written: the doc's code blocks are the test, so the two cannot drift.

In document order, every ```python block whose first line is `# file: NAME` is written to NAME,
and every ```bash block is run (one bash script, `set -euo pipefail`) in a fresh directory that
holds the checkout's recipes/; `megappo` and `python` are this checkout's (```text blocks are
output shown to the reader, not run). Then: the run learned (training and validation reward
rise), the samples and the Parquet copy are there, and the output the doc shows for
`head data/train.jsonl` is what the script writes, and every console block the doc marks as this
test's output (tests/doc_console.py) is what this run printed.
"""

import json
import os
import re
import subprocess
import sys

from tests.doc_console import check_quoted

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(REPO, "docs", "own-data.md")
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)


def doc_script(text: str) -> str:
    """The doc's python files and bash commands as one bash script, in document order."""
    parts = ["set -euo pipefail", 'megappo() { "$MEGAPPO_PYTHON" -m megappo.cli "$@"; }',
             'python() { "$MEGAPPO_PYTHON" "$@"; }']
    for lang, body in BLOCK.findall(text):
        if lang == "python":
            first = body.splitlines()[0]
            assert first.startswith("# file: "), f"a python block in {DOC} names no file: {first!r}"
            parts.append(f"cat > {first[len('# file: '):].strip()} <<'MEGAPPO_DOC_EOF'\n{body}MEGAPPO_DOC_EOF")
        elif lang == "bash":
            parts.append(body)
        else:
            assert lang == "text", f"{DOC}: ```{lang} blocks are neither run nor output"
    return "\n".join(parts)


def test_doc_blocks_are_found():
    script = doc_script(open(DOC).read())
    assert "cat > make_data.py" in script and "cat > my_reward.py" in script and "cat > to_parquet.py" in script
    assert "\nmegappo train recipes/demo-cpu.yaml \\\n" in script


def test_own_data_doc_from_nothing_to_a_learning_run(tmp_path):
    text = open(DOC).read()
    os.symlink(os.path.join(REPO, "recipes"), tmp_path / "recipes")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, MEGAPPO_PYTHON=sys.executable)
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(["bash", "-c", doc_script(text)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "Traceback" not in out
    # the doc's data passes the data check; its validation file is its 16 training questions, said in one
    # line, the line the doc shows
    warnings = [line for line in out.splitlines() if "megappo: warning" in line]
    assert len(warnings) == 1 and warnings[0].startswith("megappo: warning: 16 of 16 rows of data.val_files")
    assert warnings[0] in text
    train = (tmp_path / "data" / "train.jsonl").read_text().splitlines()
    assert len(train) == 640 and "\n".join(train[:2]) in text  # the doc shows what the script writes

    run = tmp_path / "runs" / "my-sums"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "critic/score/mean" in r]
    val = [r["val/score/mean"] for r in rows if "val/score/mean" in r]
    assert len(steps) == 40 and len(val) == 3  # before training, steps 20 and 40
    assert all(0 <= r["critic/score/frac_correct"] <= 1 for r in steps)  # the fully correct responses
    assert all("val/score/frac_correct" in r for r in rows if "val/score/mean" in r)
    first = sum(r["critic/score/mean"] for r in steps[:10]) / 10
    last = sum(r["critic/score/mean"] for r in steps[-10:]) / 10
    assert last >= first + 0.1, f"the reward did not rise: first 10 steps {first:.3f}, last 10 {last:.3f}"
    assert val[-1] >= val[0] + 0.15, f"greedy validation did not improve: {val}"
    for line in out.splitlines():  # the doc's metrics one-liner printed the same numbers
        if re.fullmatch(r"(0|20|40) [0-9.]+", line):
            step, score = line.split()
            assert float(score) == val[[0, 20, 40].index(int(step))]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == list(range(1, 41)) and samples[-1]["data_source"] == "my_sums"
    assert json.dumps(samples[-1]) in out  # the tail shown
    check_quoted(out, __file__)  # the console lines the doc quotes (marked blocks: tests/doc_console.py)

    from megappo.data.prompts import load_rows  # the Parquet copy reads back as the same rows

    for split in ("train", "val"):
        base = tmp_path / "data" / split
        assert load_rows([f"{base}.parquet"]) == load_rows([f"{base}.jsonl"])
