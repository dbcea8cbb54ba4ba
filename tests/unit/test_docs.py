"""README.md is the front page and docs/ the reference: README links every docs page, every
relative link in README.md and docs/*.md names a file that exists, and README stays short."""

import glob
import os
import re

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
