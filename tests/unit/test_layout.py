"""The package's layout: docs/layout.md names every module of megappo/ and only modules that
exist; its layer table puts every module in one layer, and every import (counting imports inside
functions, which hide a dependency until one side is refactored) goes to the module's own layer or
one below it; no modules import each other. Read from the source files: nothing is imported."""

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


#: a line of docs/layout.md's layer table: `L<n>  megappo/<package>/ megappo/<module>.py ...  what it holds`
LAYER_LINE = re.compile(r"^L(\d+)\s+((?:megappo/[\w/]*(?:\.py)?\s+)+)", re.M)


def layers() -> list[tuple[int, list[str]]]:
    """docs/layout.md's layer table, top to bottom: (layer number, the dotted prefixes it holds)."""
    text = open(os.path.join(REPO, "docs", "layout.md")).read()
    return [(int(n), [p.removesuffix(".py").rstrip("/").replace("/", ".") for p in paths.split()])
            for n, paths in LAYER_LINE.findall(text)]


def layer_of(module: str, table: list[tuple[int, list[str]]]) -> int | None:
    """The layer of `module`: the one naming the longest prefix of it (`megappo` itself: the package)."""
    best = None
    for number, prefixes in table:
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (number, len(prefix))
    return best and best[0]


def upward_imports(graph: dict[str, set[str]], table: list[tuple[int, list[str]]]) -> list[str]:
    """Every import of `graph` that goes to a higher layer than its module's."""
    return [f"{name} (L{layer_of(name, table)}) imports {imp} (L{layer_of(imp, table)})"
            for name in sorted(graph) for imp in sorted(graph[name])
            if layer_of(imp, table) > layer_of(name, table)]


def test_layer_table_is_drawn_in_order_and_holds_every_module():
    table = layers()
    assert [n for n, _ in table] == list(range(len(table) - 1, -1, -1)), \
        "docs/layout.md's layer table must list L<top> down to L0, one line each"
    loose = sorted(m for m in modules() if m != "megappo" and layer_of(m, table) is None)
    assert not loose, f"docs/layout.md's layer table holds no layer for {loose}: add the package or module to one"


def test_imports_go_down_the_layers():
    table, known = layers(), set(modules())
    graph = {name: imports(path, known) - {name, "megappo"} for name, path in modules().items() if name != "megappo"}
    wrong = upward_imports(graph, table)
    assert not wrong, ("imports against docs/layout.md's layer order (a module imports its own layer and the "
                       "ones below):\n  " + "\n  ".join(wrong))


def test_the_layer_check_finds_an_upward_import():
    table = [(2, ["megappo.trainer"]), (1, ["megappo.rollout"]), (0, ["megappo.errors", "megappo.rollout.engine"])]
    assert layer_of("megappo.rollout.engine", table) == 0 and layer_of("megappo.rollout.bridge", table) == 1
    assert upward_imports({"megappo.rollout.bridge": {"megappo.errors", "megappo.rollout.engine"},
                           "megappo.trainer.step": {"megappo.rollout.bridge"}}, table) == []
    assert upward_imports({"megappo.rollout.engine": {"megappo.rollout.bridge"}}, table) == [
        "megappo.rollout.engine (L0) imports megappo.rollout.bridge (L1)"]


def test_layout_doc_names_every_module_and_only_existing_ones():
    text = open(os.path.join(REPO, "docs", "layout.md")).read()
    named = set(re.findall(r"\bmegappo/[\w/]+\.py\b", text))
    files = {os.path.relpath(p, REPO).replace(os.sep, "/") for p in modules().values()
             if not p.endswith("__init__.py")}
    assert not files - named, f"docs/layout.md does not name {sorted(files - named)}: add a line for each"
    every = {os.path.relpath(p, REPO).replace(os.sep, "/") for p in modules().values()}
    assert not named - every, f"docs/layout.md names {sorted(named - every)}, which do not exist: remove them"


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


def test_the_imports_docs_named_before_the_packages_still_work(monkeypatch):
    """docs/environments.md's snippet imported load_tokenizer from megappo.tokenizer and build_prompts from
    megappo.data: the first warns once and names the new place, the second is the data package's own name."""
    import sys

    import pytest

    from megappo.data import prompts, tokenizer

    monkeypatch.delitem(sys.modules, "megappo.tokenizer", raising=False)
    with pytest.warns(DeprecationWarning, match="from megappo.data.tokenizer"):
        import megappo.tokenizer as old
    assert old.load_tokenizer is tokenizer.load_tokenizer and old.chat_template_ids is tokenizer.chat_template_ids
    import megappo.data as data

    assert (data.build_prompts, data.builtin_rows, data.load_rows, data.random_policy_score) == (
        prompts.build_prompts, prompts.builtin_rows, prompts.load_rows, prompts.random_policy_score)
