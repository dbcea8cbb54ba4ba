"""Each config field's documentation, written once as the docstring under the field (the string
literal after it, as torchtitan writes its config), and docs/config.md's field tables generated
from those docstrings and the fields' defaults.

In docs/config.md a table sits between `<!-- fields PATH: ... -->` and `<!-- end fields -->`, PATH
a section's dotted path (`actor`, `actor.optim`). A section nested in it is a row of its own
followed by its fields as `name.field` rows (`policy_loss.loss_mode`), unless the page gives its
class a table of its own (the `<role>.optim` table serves actor.optim and critic.optim), when it
is one row. The prose around the tables is the page's own.

    python -m megappo.config.field_docs           # rewrite docs/config.md's tables
    python -m megappo.config.field_docs --check   # exit 1 when they differ from the docstrings

Owns: reading field docstrings, the tables, the page's markers. Does not know what any field
means: that is in the section modules' docstrings.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import pathlib
import re
import sys
import textwrap
from typing import Any

from megappo.config.root import Config
from megappo.config.schema import _hints, _options

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "config.md"
COMMAND = "python -m megappo.config.field_docs"
_TABLE = re.compile(r"(<!-- fields ([\w.]+)[^\n]*-->\n)(.*?)(<!-- end fields -->)", re.S)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring (lines joined into one paragraph), for a config section class."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for field, after in zip(body, body[1:]):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[field.target.id] = " ".join(inspect.cleandoc(after.value.value).split("\n"))
    return docs


def section_at(path: str) -> type:
    """The section class at a dotted path of Config (`actor.optim` -> OptimConfig)."""
    cls = Config
    for name in path.split("."):
        cls = _options(_hints(cls)[name])[0]
        assert dataclasses.is_dataclass(cls), f"{path} is not a config section"
    return cls


def yaml_text(value: Any) -> str:
    """A default as a recipe writes it: null, true, 1e-6, [a, b], {k: v}."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, float):
        return re.sub(r"e([+-])0*(\d)", lambda m: f"e{m.group(1).replace('+', '')}{m.group(2)}", repr(value))
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(yaml_text(v) for v in value)}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_text(v)}" for k, v in value.items()) + "}"
    return str(value)


def default_text(field: dataclasses.Field) -> str:
    """The table's default cell: the value, or for a section the fields that differ from its class's defaults."""
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        changed = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)
                   if getattr(value, f.name) != getattr(type(value)(), f.name)}
        return f"`{yaml_text(changed)}`" if changed else ""
    return f"`{yaml_text(value)}`"


def rows(cls: type, own_tables: set[type], prefix: str = "") -> list[str]:
    """One row per field of `cls`; a nested section without a table of its own adds its fields after its row."""
    docs, out = field_docs(cls), []
    for f in dataclasses.fields(cls):
        assert f.name in docs, f"{cls.__name__}.{f.name} has no docstring: write one under the field"
        text = docs[f.name].replace("|", "\\|")
        out.append(f"| `{prefix}{f.name}` | {default_text(f)} | {text} |")
        nested = _options(_hints(cls)[f.name])[0]
        if dataclasses.is_dataclass(nested) and nested not in own_tables:
            out += rows(nested, own_tables, f"{prefix}{f.name}.")
    return out


def render(page: str) -> str:
    """`page` with every marked table written from the docstrings."""
    own_tables = {section_at(m.group(2)) for m in _TABLE.finditer(page)}

    def table(m: re.Match) -> str:
        lines = ["| field | default | meaning |", "|---|---|---|", *rows(section_at(m.group(2)), own_tables)]
        return m.group(1) + "\n".join(lines) + "\n" + m.group(4)

    return _TABLE.sub(table, page)


def tables(page: str) -> list[str]:
    """The dotted paths the page has tables for."""
    return [m.group(2) for m in _TABLE.finditer(page)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description="docs/config.md's field tables from the docstrings")
    parser.add_argument("--check", action="store_true", help="exit 1 when the page differs, writing nothing")
    parser.add_argument("--page", default=str(PAGE))
    args = parser.parse_args(argv)
    page = pathlib.Path(args.page)
    old = page.read_text()
    new = render(old)
    if args.check:
        if new != old:
            print(f"{page}: the field tables differ from the fields' docstrings in megappo/config/. Fix: {COMMAND}")
            return 1
        return 0
    if new != old:
        page.write_text(new)
        print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
