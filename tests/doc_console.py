"""Console lines quoted in README.md and docs/*.md, checked against a real run's output.

A quoted block is marked by an HTML comment (invisible on the rendered page) on the line before its
```text fence, naming the test whose run prints it:

    <!-- console: tests/e2e/test_own_data_doc.py -->
    ```text
    megappo: world=2 tp=2 pp=1 dp=1 | prompts=640 | steps=40 | ...
    ```

That test calls `check_quoted(output, __file__)`, which asserts every line of every block marked with
its name is a line of the output, in the block's order (other output lines may come between them).
Placeholders, so that a quote shows a real run without pinning what varies from run to run:

- a number with a decimal point (`0.6684`, `-1.5e-3`) matches any number: scores, losses, timings;
  integers (`step 40`, `prompts=640`, `step_00000040`) must match exactly;
- `...` inside a line matches any text (metrics left out, a temporary path);
- a line that is only `...` stands for lines left out (blank lines are ignored too).

Nothing else is a wildcard: the words, keys and their order are checked as printed."""

import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!-- console: (\S+) -->\n```text\n(.*?)^```$", re.S | re.M)
DECIMAL = re.compile(r"-?\d+\.\d+(?:e[-+]?\d+)?")
NUMBER = r"(?:-?\d+(?:\.\d+)?(?:e[-+]?\d+)?|-?inf|nan)"


def doc_files() -> list:
    return [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]


def marked_blocks(test_name: str = None) -> list:
    """(doc path relative to the repo, test name, [quoted lines]) for every marked block (of one test)."""
    blocks = []
    for path in doc_files():
        for name, body in MARKER.findall(open(path).read()):
            if test_name is None or name == test_name:
                lines = [line.rstrip() for line in body.splitlines() if line.strip() and line.strip() != "..."]
                blocks.append((os.path.relpath(path, REPO), name, lines))
    return blocks


def line_pattern(quoted: str) -> "re.Pattern":
    """The regex one quoted line stands for (module docstring: decimals and `...` are placeholders)."""
    parts, pos = [], 0
    for m in re.finditer(r"\.\.\.|" + DECIMAL.pattern, quoted):
        parts.append(re.escape(quoted[pos:m.start()]))
        parts.append(".*?" if m.group() == "..." else NUMBER)
        pos = m.end()
    parts.append(re.escape(quoted[pos:]))
    return re.compile("".join(parts))


def unmatched(quoted: list, output: str) -> list:
    """The quoted lines not found in the output in order (empty when the quote holds)."""
    out_lines = [line.rstrip() for line in output.splitlines()]
    missing, at = [], 0
    for line in quoted:
        pattern = line_pattern(line)
        hit = next((i for i in range(at, len(out_lines)) if pattern.fullmatch(out_lines[i])), None)
        if hit is None:
            missing.append(line)
        else:
            at = hit + 1
    return missing


def check_quoted(output: str, test_file: str) -> int:
    """Assert every block marked with this test's name matches `output`; returns how many blocks."""
    name = os.path.relpath(os.path.abspath(test_file), REPO)
    blocks = marked_blocks(name)
    assert blocks, f"no doc block is marked <!-- console: {name} -->"
    for doc, _, lines in blocks:
        missing = unmatched(lines, output)
        assert not missing, (f"{doc} quotes console lines (marked {name}) this run did not print: {missing}; "
                             f"the run printed:\n{output[-4000:]}")
    return len(blocks)
