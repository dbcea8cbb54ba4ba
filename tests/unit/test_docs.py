"""README.md is the front page and docs/ the reference: README links every docs page, every
relative link in README.md and docs/*.md names a file that exists, and README stays short."""

import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
README_MAX_LINES = 260


def read(path):
    with open(path) as f:
        return f.read()


def doc_files():
    return [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]


def relative_links(path):
    text = re.sub(r"```.*?```", "", read(path), flags=re.DOTALL)  # code blocks hold no links
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # https:, mailto:, same-page anchors
        yield target.split("#", 1)[0]


def test_readme_links_every_docs_page():
    linked = {os.path.normpath(t) for t in relative_links(os.path.join(REPO, "README.md"))}
    pages = {os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md"))}
    assert pages, "no docs pages"
    missing = sorted(pages - linked)
    assert not missing, f"README.md does not link {missing}: add them to its Documentation table"


def test_every_relative_link_resolves():
    broken = []
    for path in doc_files():
        for target in relative_links(path):
            if not os.path.exists(os.path.join(os.path.dirname(path), target)):
                broken.append(f"{os.path.relpath(path, REPO)} -> {target}")
    assert not broken, f"links to files that do not exist: {broken}"


def test_readme_is_short():
    n = len(read(os.path.join(REPO, "README.md")).splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move reference to docs/"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but '-' and '_' dropped, spaces -> '-'."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path):
    text = re.sub(r"```.*?```", "", read(path), flags=re.DOTALL)
    return {slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_every_anchor_resolves():
    """A link to `page.md#anchor` (or `#anchor` on the same page) names a heading that page has."""
    broken = []
    for path in [*doc_files(), os.path.join(REPO, "benchmarks", "RESULTS.md"), os.path.join(REPO, "benchmarks", "GPU.md")]:
        text = re.sub(r"```.*?```", "", read(path), flags=re.DOTALL)
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or "#" not in target:
                continue
            page, anchor = target.split("#", 1)
            page = os.path.join(os.path.dirname(path), page) if page else path
            if page.endswith(".md") and os.path.exists(page) and anchor not in anchors(page):
                broken.append(f"{os.path.relpath(path, REPO)} -> {target}")
    assert not broken, f"links to headings that do not exist: {broken}"


def test_quoted_console_lines_are_checked():
    """Every console block marked `<!-- console: TEST -->` (tests/doc_console.py) names a test that checks
    it against its run's output, and the matcher's placeholders mean what that module says."""
    from tests.doc_console import check_quoted, marked_blocks, unmatched

    blocks = marked_blocks()
    assert {name for _, name, _ in blocks} >= {"tests/e2e/test_own_data_doc.py", "tests/e2e/test_lora.py",
                                                "tests/e2e/test_cli_demo.py"}
    for doc, name, lines in blocks:
        assert lines, f"{doc}: an empty block marked {name}"
        test = os.path.join(REPO, name)
        assert os.path.isfile(test) and "check_quoted(" in read(test), f"{doc}: {name} does not call check_quoted"
    out = "megappo: world=2 | steps=40\nnoise\nstep 1: a/b=0.02344 c=-1.5e-3 | 1/2 steps\nsaved /tmp/x/step_00000040"
    assert unmatched(["megappo: world=2 | steps=40", "step 1: a/b=0.5 ...", "saved .../step_00000040"], out) == []
    assert unmatched(["megappo: world=2 | steps=41"], out)  # integers are exact
    assert unmatched(["step 1: a/b=0.5 c=2.0"], out)  # a line matches whole, not a prefix
    assert unmatched(["saved .../step_00000040", "megappo: world=2 | steps=40"], out)  # order counts
    assert unmatched(["step 1: a/x=0.5 ..."], out)  # keys are literal
    with pytest.raises(AssertionError, match="no doc block is marked"):  # a test with no quote is told so
        check_quoted(out, os.path.join(REPO, "tests", "e2e", "no_such_test.py"))


def test_recipe_tables_name_every_recipe():
    """README's recipe table names every recipe, docs/gpu.md's every GPU recipe (a new one is added to both)."""
    recipes = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "recipes", "*.yaml")))
    readme, gpu = read(os.path.join(REPO, "README.md")), read(os.path.join(REPO, "docs", "gpu.md"))
    assert not [r for r in recipes if f"`{r}`" not in readme], "README.md's recipe table misses recipes"
    missing = [r for r in recipes if not r.endswith("-cpu.yaml") and f"`{r}`" not in gpu]
    assert not missing, f"docs/gpu.md's recipe table misses {missing}"
