"""verl's data.custom_cls and data.sampler through the CLI: the demo task's prompts read from a file in
another layout by a dataset class, ordered by a sampler class, trained for 2 steps; the run says nothing
about either key as a verl key (they are megappo's)."""

import json

import pytest

from tests.e2e.test_algorithms import ONE_RANK, train

pytestmark = pytest.mark.one_process  # a world of one (tests/conftest.py)

CLASSES = '''
class DigitRows:
    """{"digit": d} JSONL rows into verl's layout (the demo's digit_successor task)."""

    def __init__(self, data_files, config):
        self.rows = []
        for path in data_files:
            for line in open(path):
                d = json.loads(line)["digit"]
                self.rows.append({"data_source": "digit_successor", "prompt": f"{d}>",
                                  "reward_model": {"style": "rule", "ground_truth": str((d + 1) % 10)}})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class Backwards:
    def __init__(self, data_source, data_config):
        self.n = len(data_source)

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))
'''


def test_dataset_and_sampler_classes_train(tmp_path):
    (tmp_path / "classes.py").write_text("import json\n" + CLASSES)
    with open(tmp_path / "digits.jsonl", "w") as f:
        for i in range(128):
            f.write(json.dumps({"digit": i % 10}) + "\n")
    rows = train(tmp_path / "run", [*ONE_RANK, "data.builtin=null", f"data.train_files=[{tmp_path / 'digits.jsonl'}]",
                                    f"data.custom_cls.path={tmp_path / 'classes.py'}", "data.custom_cls.name=DigitRows",
                                    f"data.sampler.class_path={tmp_path / 'classes.py'}",
                                    "data.sampler.class_name=Backwards"])
    assert len(rows) == 2 and all("critic/score/mean" in r for r in rows)
    assert not (tmp_path / "run" / "verl_keys.log").exists() or "custom_cls" not in \
        (tmp_path / "run" / "verl_keys.log").read_text()
