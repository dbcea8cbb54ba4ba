"""The package's layout: docs/layout.md names every module of megappo/ and only modules that
exist, and no modules import each other (counting imports inside functions, which hide a cycle
until one side is refactored). Read from the source files: nothing is imported."""

import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(REPO, "megappo")


def modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of megappo/ (packages' __init__ included)."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                found[dotted.removesuffix(".__init__")] = path
    return found


def imports(path: str, known: set[str]) -> set[str]:
    """The megappo modules a file imports anywhere in it (`from megappo.x import y` counts
    megappo.x.y when y is a module)."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return names & known


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (module -> modules it imports), or None (depth-first search)."""
    state, trail = {}, []

    def visit(node):
        state[node] = "open"
        trail.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return trail[trail.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        trail.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_layout_doc_names_every_module_and_only_existing_ones():
    text = open(os.path.join(REPO, "docs", "layout.md")).read()
    named = set(re.findall(r"\bmegappo/[\w/]+\.py\b", text))
    files = {os.path.relpath(p, REPO).replace(os.sep, "/") for p in modules().values()
             if not p.endswith("__init__.py")}
    assert not files - named, f"docs/layout.md does not name {sorted(files - named)}: add a line for each"
    assert not named - files, f"docs/layout.md names {sorted(named - files)}, which do not exist: remove them"


def test_no_import_cycles():
    known = set(modules())
    graph = {name: imports(path, known) - {name} for name, path in modules().items()}
    assert not cycle(graph), f"import cycle: {' -> '.join(cycle(graph))}"


def test_cycle_finder_finds_a_cycle_through_a_function_level_import():
    # the shape the rollout engines had: engine.py built the engines in functions, and they import it
    assert cycle({"engine": {"hf_engine"}, "hf_engine": {"engine"}, "bridge": {"engine"}}) == [
        "engine", "hf_engine", "engine"]
    assert cycle({"engine": set(), "engines": {"engine", "hf_engine"}, "hf_engine": {"engine"}}) is None


def test_errors_keep_their_old_import_paths():
    from megappo import config, errors
    from megappo.models import hf_config

    assert config.ConfigError is errors.ConfigError and hf_config.ModelConfigError is errors.ModelConfigError
