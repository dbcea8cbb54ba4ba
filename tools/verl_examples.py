#!/usr/bin/env python3
"""How many of verl's example command lines megappo reads as written, and what the others need.

  python tools/verl_examples.py VERL_DIR [--rev REV] [--under examples] [--entry main_ppo] [--keys]

VERL_DIR is a verl checkout (its work tree is read) or, with --rev, any git directory of verl (bare
too: the scripts are read with `git show REV:path`). Every `*.sh` under --under is read as bash is,
without running it: backslash continuations joined, comments dropped, variables and arrays assigned
in order (`X=${X:-default}`, `A=(...)`, `A+=(...)`, `export`) and expanded where they are used
(`$X`, `${X:-d}`, `"${A[@]}"`, `$((...))`); an unset variable expands to nothing, as in bash, and is
named. Each command whose words hold the entry (`-m verl.trainer.main_ppo`, `main_ppo.py`) is one
command line; the words after it, less Hydra's `--config-path` / `--config-name` flags, are read by
megappo.config.loading.read_config as `megappo train` reads them: on the recipe `--config-name` names (verl
0.9.1's defaults, recipes/verl/, for verl's own trainer configs), else on megappo's defaults (no recipe).
Printed: the count read and refused, each refused line with the error's lines (each names the feature
and its fix), what the refused lines need and the refused keys by how often they come; --keys adds
every key's reading by count (the keys to add to megappo/config/verl_keys.py's tables next).

This tool knows bash's quoting and expansion, not verl: it asks megappo what a key means. It runs
no code of the scripts (a command substitution `$(...)` expands to nothing but `$(pwd)`).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import sys
from typing import Iterator, Optional

#: the environment a script starts in (bash's own variables it reads)
START_ENV = {"HOME": "/home/user", "PWD": "/verl", "USER": "user"}


@dataclasses.dataclass
class CommandLine:
    """One command of a script that starts the entry: the words after it, and the variables the script
    used up to it that no assignment set (they expanded to nothing)."""

    script: str
    words: list[str]
    unset: list[str]


def statements(text: str) -> Iterator[list[str]]:
    """The script's simple commands, each as its words in raw form (quotes and `$` kept): split at
    unquoted newlines, `;`, `&&`, `||`, `|` and parentheses; an array assignment `A=( ... )` is one
    word; comments and here-documents are skipped."""
    words: list[str] = []
    word: Optional[str] = None
    heredocs: list[str] = []
    i, n = 0, len(text)

    def close(target: str, start: int) -> int:
        """The index just past the bracket that closes the one before `start` (quotes honoured)."""
        opening = {")": "(", "}": "{"}[target]
        depth, j = 1, start
        while j < n and depth:
            c = text[j]
            if c == "\\":
                j += 2
                continue
            if c == "'" and opening == "(":
                j = text.find("'", j + 1) + 1 or n
                continue
            if c == '"':
                j = _quote_end(text, j)
                continue
            depth += (c == opening) - (c == target)
            j += 1
        return j

    while i < n:
        c = text[i]
        if c == "\\" and i + 1 < n and text[i + 1] == "\n":  # continuation
            i += 2
            continue
        if c in " \t":
            if word is not None:
                words.append(word)
            word = None
            i += 1
            continue
        if c in "<>" or c == "&" and text[i + 1:i + 2] == ">":  # a redirection and its target: dropped
            if c == "<" and text[i:i + 2] == "<<" and text[i:i + 3] != "<<<":
                m = re.match(r"<<-?\s*['\"]?(\w+)['\"]?", text[i:])
                if m:
                    heredocs.append(m.group(1))
                    i += m.end()
                    continue
            if word is not None and word.isdigit():
                word = None
            m = re.match(r"&?[<>]+(&\d+|&-)?[ \t]*", text[i:])
            i += m.end()
            if not m.group(1):  # the target word
                while i < n and text[i] not in " \t\n;&|()":
                    i = _quote_end(text, i) if text[i] == '"' else i + 1
            continue
        if c in "\n;&|()":
            if c == "(" and word is not None and word.endswith("="):  # array assignment: one word
                end = close(")", i + 1)
                word += text[i:end]
                i = end
                continue
            if word is not None:
                words.append(word)
            word = None
            if words:
                yield words
            words = []
            if c == "\n" and heredocs:  # skip each here-document's body
                for delim in heredocs:
                    m = re.compile(rf"^\s*{re.escape(delim)}\s*$", re.M).search(text, i + 1)
                    i = m.end() if m else n
                heredocs = []
            i += 1
            continue
        if c == "#" and word is None:
            i = text.find("\n", i)
            i = n if i < 0 else i
            continue
        if word is None:
            word = ""
        if c == "\\":
            word += text[i:i + 2]
            i += 2
        elif c == "'":
            end = text.find("'", i + 1)
            end = n if end < 0 else end + 1
            word += text[i:end]
            i = end
        elif c == '"':
            end = _quote_end(text, i)
            word += text[i:end]
            i = end
        elif c == "$" and text[i + 1:i + 2] in ("(", "{"):
            end = close(")" if text[i + 1] == "(" else "}", i + 2)
            word += text[i:end]
            i = end
        else:
            word += c
            i += 1
    if word is not None:
        words.append(word)
    if words:
        yield words


def _quote_end(text: str, i: int) -> int:
    """The index just past the double-quoted string that starts at `i` (escapes and `$(...)` honoured)."""
    j = i + 1
    while j < len(text) and text[j] != '"':
        if text[j] == "\\":
            j += 1
        elif text[j] == "$" and text[j + 1:j + 2] == "(":  # a nested "..." inside $(...)
            depth, j = 1, j + 2
            while j < len(text) and depth:
                depth += (text[j] == "(") - (text[j] == ")")
                j += 1
            continue
        j += 1
    return j + 1


class Shell:
    """Variables as a script assigns them, and bash's expansion of a raw word."""

    _ASSIGN = re.compile(r"^([A-Za-z_][A-Za-z_0-9]*)(\+?)=(.*)$", re.S)
    _PREFIX = ("export", "local", "declare", "readonly", "typeset")

    def __init__(self) -> None:
        self.env: dict[str, list[str] | str] = dict(START_ENV)
        self.unset: list[str] = []

    def run(self, raw: list[str]) -> Optional[list[str]]:
        """Carry out `raw`'s assignments; the words of a command (its leading assignments dropped), or None."""
        words = list(raw)
        if words and words[0] in self._PREFIX:
            words = [w for w in words[1:] if not w.startswith("-")]
            for w in words:
                if self._ASSIGN.match(w):
                    self.assign(w)
            return None
        while words and self._ASSIGN.match(words[0]):
            if len(words) == 1:  # a bare assignment sets the variable
                self.assign(words[0])
            words = words[1:]
        if not words:
            return None
        out: list[str] = []
        for w in words:
            out += self.expand(w)
        return out

    def assign(self, word: str) -> None:
        name, append, value = self._ASSIGN.match(word).groups()
        if value.startswith("(") and value.endswith(")"):
            items: list[str] = []
            for inner in statements(value[1:-1]):
                for w in inner:
                    items += self.expand(w)
            before = self.env.get(name, [])
            self.env[name] = ([before] if isinstance(before, str) else list(before)) + items if append else items
        else:
            text = "".join(self.expand(value, split=False))
            self.env[name] = self.scalar(name) + text if append else text

    def scalar(self, name: str) -> str:
        value = self.env.get(name, "")
        return value[0] if isinstance(value, list) and value else value if isinstance(value, str) else ""

    def expand(self, raw: str, split: bool = True) -> list[str]:
        """The words bash makes of `raw` (one word when `split` is false, as an assignment's value is)."""
        words: list[Optional[str]] = [None]  # None: no word yet (an unquoted empty expansion makes none)

        def add(text: str) -> None:
            words[-1] = (words[-1] or "") + text

        i, n = 0, len(raw)
        quoted = False
        emptied: set[int] = set()  # words that are an empty "${A[@]}" so far
        while i < n:
            c = raw[i]
            if c == '"':
                quoted = not quoted
                add("")
                i += 1
            elif c == "'" and not quoted:
                end = raw.find("'", i + 1)
                end = n if end < 0 else end
                add(raw[i + 1:end])
                i = end + 1
            elif c == "\\":
                nxt = raw[i + 1:i + 2]
                add("" if nxt == "\n" else nxt if not quoted or nxt in '$`"\\' else c + nxt)
                i += 2
            elif c == "$" and i + 1 < n:
                values, i, array = self._dollar(raw, i + 1)
                if array and quoted:  # "${A[@]}": one word per item ("$@" of no arguments: no word)
                    if not values and not words[-1]:
                        emptied.add(len(words) - 1)
                    for k, v in enumerate(values):
                        if k:
                            words.append(v)
                        else:
                            add(v)
                elif quoted or not split:
                    add(" ".join(values))
                else:  # unquoted: split into fields
                    fields = " ".join(values).split()
                    text = " ".join(values)
                    if text[:1].isspace() and words[-1] is not None:
                        words.append(None)
                    for k, f in enumerate(fields):
                        if k:
                            words.append(f)
                        else:
                            add(f)
                    if text[-1:].isspace() and fields:
                        words.append(None)
            else:
                add(c)
                i += 1
        done = [w for k, w in enumerate(words) if w is not None and not (k in emptied and w == "")]
        return ["".join(done)] if not split else done

    def _dollar(self, raw: str, i: int) -> tuple[list[str], int, bool]:
        """The values of the expansion after the `$` at i - 1, the index past it, and whether it is an array's
        items."""
        if raw.startswith("((", i):
            depth, end = 2, i + 2
            while end < len(raw) and depth:
                depth += (raw[end] == "(") - (raw[end] == ")")
                end += 1
            expr = "".join(self.expand(raw[i + 2:end - 2], split=False))
            expr = re.sub(r"[A-Za-z_]\w*", lambda m: self.scalar(m.group(0)) or "0", expr).replace("/", "//")
            try:
                value = str(int(eval(expr, {"__builtins__": {}}))) if re.fullmatch(r"[\d\s+\-*/%()]+", expr) else ""
            except (SyntaxError, ZeroDivisionError):
                value = ""
            return [value], end, False
        if raw.startswith("(", i):
            depth, j = 1, i + 1
            while j < len(raw) and depth:
                depth += (raw[j] == "(") - (raw[j] == ")")
                j += 1
            return ([self.scalar("PWD")] if raw[i + 1:j - 1].strip() == "pwd" else [""]), j, False
        if raw.startswith("{", i):
            depth, j = 1, i + 1
            while j < len(raw) and depth:
                depth += (raw[j] == "{") - (raw[j] == "}")
                j += 1
            values, array = self._braced(raw[i + 1:j - 1])
            return values, j, array
        m = re.match(r"[A-Za-z_]\w*|[@*#?0-9$!-]", raw[i:])
        if not m:
            return ["$"], i, False
        name = m.group(0)
        if name in ("@", "*"):  # the script's own arguments: none
            return [], i + 1, True
        return [self._value(name)], i + len(name), False

    def _braced(self, inner: str) -> tuple[list[str], bool]:
        m = re.match(r"([A-Za-z_]\w*|[@*0-9])(\[[@*]\])?(.*)$", inner, re.S)
        if not m:  # ${#X}, ${!X}: not followed
            return [""], False
        name, index, rest = m.groups()
        if name in ("@", "*"):
            return [], True
        if index:
            value = self.env.get(name, [])
            return ([value] if isinstance(value, str) else list(value)), True
        op = re.match(r"(:?[-=+])(.*)$", rest, re.S)
        set_ = name in self.env and (self.scalar(name) != "" or not (op and op.group(1).startswith(":")))
        if op:
            word = "".join(self.expand(op.group(2), split=False))
            if op.group(1).endswith("+"):
                return [word if set_ else ""], False
            if not set_:
                if op.group(1).endswith("="):
                    self.env[name] = word
                return [word], False
        return [self._value(name)], False  # ${X%...}, ${X//a/b} and the like: X as it is

    def _value(self, name: str) -> str:
        if name not in self.env and name not in self.unset:
            self.unset.append(name)
        return self.scalar(name)


def command_lines(text: str, script: str = "", entry: str = "main_ppo") -> list[CommandLine]:
    """Every command of a bash script `text` that starts `entry` (a module `-m ...entry` or a file
    `entry.py`), with the words after it."""
    shell, out = Shell(), []
    pattern = re.compile(rf"(^|[./]){re.escape(entry)}(\.py)?$")
    for raw in statements(text):
        words = shell.run(raw)
        if not words:
            continue
        at = next((k for k, w in enumerate(words) if pattern.search(w)), None)
        if at is not None:
            out.append(CommandLine(script, words[at + 1:], list(shell.unset)))
    return out


def overrides(words: list[str]) -> list[str]:
    """A command line's Hydra overrides: the words less `--config-path`/`--config-name` (with a value of
    their own or the next word) and other flags."""
    out, skip = [], False
    for w in words:
        if skip:
            skip = False
        elif w.startswith("-"):
            skip = "=" not in w and w.lstrip("-") in ("config-path", "config-name", "cp", "cn")
        elif w.strip():
            out.append(w)
    return out


def hydra_flags(words: list[str]) -> tuple[Optional[str], Optional[str]]:
    """(--config-path, --config-name) of a command line's words (`--flag=value` or `--flag value`), None where
    not given."""
    found: dict[str, Optional[str]] = {"config-path": None, "config-name": None}
    short = {"cp": "config-path", "cn": "config-name"}
    for k, w in enumerate(words):
        flag, eq, value = w.lstrip("-").partition("=")
        flag = short.get(flag, flag)
        if w.startswith("-") and flag in found:
            found[flag] = value if eq else (words[k + 1] if k + 1 < len(words) else None)
    return found["config-path"], found["config-name"]


def scripts(root: str, rev: Optional[str], under: str) -> Iterator[tuple[str, str]]:
    """(path, text) of every `*.sh` under `under` of a verl checkout, or of revision `rev` of its git dir."""
    if rev:
        names = subprocess.run(["git", "-C", root, "ls-tree", "-r", "--name-only", rev, "--", under],
                               capture_output=True, text=True, check=True).stdout.split()
        for name in sorted(n for n in names if n.endswith(".sh")):
            yield name, subprocess.run(["git", "-C", root, "show", f"{rev}:{name}"], capture_output=True,
                                       text=True, check=True).stdout
        return
    base = os.path.join(root, under)
    for dirpath, _, files in sorted(os.walk(base)):
        for f in sorted(files):
            if f.endswith(".sh"):
                path = os.path.join(dirpath, f)
                with open(path, errors="replace") as fh:
                    yield os.path.relpath(path, root), fh.read()


_REFUSED = re.compile(r"^\s*(?:- )?'([^'=]+)=")
_UNKNOWN = re.compile(r"unknown config key '([^']+)'")


def need(error: str) -> str:
    """What a refused line needs, in a few words: a refused verl key's fix up to its first ';' or ':' (the
    key itself where the fix is the generic 'no such key'), else the error up to its fix."""
    m = _REFUSED.match(error)
    if m and "Fix: " in error:
        fix = error.split("Fix: ", 1)[1]
        first = re.split(r"[;:]", fix, 1)[0].strip()
        return f"{m.group(1)} (no such key)" if first.startswith("megappo has no such key") else first
    m = _UNKNOWN.search(error)
    if m:
        return f"{m.group(1)} (unknown key)"
    return re.sub(r"^- ", "", error.strip()).split(". Fix:")[0]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("verl_dir")
    p.add_argument("--rev", help="a revision of VERL_DIR's git history (default: its work tree)")
    p.add_argument("--under", default="examples", help="the folder whose scripts are read (default: examples)")
    p.add_argument("--entry", default="main_ppo", help="the trainer's module or file name (default: main_ppo)")
    p.add_argument("--keys", action="store_true", help="also every key's reading, by how often it comes")
    args = p.parse_args(argv)

    from megappo.errors import ConfigError
    from megappo.config.loading import _key_value, read_config, read_overrides, verl_config_recipe

    lines = [cl for path, text in scripts(args.verl_dir, args.rev, args.under)
             for cl in command_lines(text, path, args.entry)]
    refused: list[tuple[CommandLine, list[str]]] = []
    needs: collections.Counter = collections.Counter()
    by_key: collections.Counter = collections.Counter()
    fixes: dict[str, str] = {}
    readings: collections.Counter = collections.Counter()
    left_out: dict[str, list[str]] = {}
    for cl in lines:
        given = overrides(cl.words)
        # an empty value: a placeholder of the script's, or a variable it takes from its environment or arguments
        left_out[cl.script] = [o for o in given if o.endswith("=")]
        given = [o for o in given if not o.endswith("=")]
        if args.keys:
            _, reading, errors = read_overrides(given)
            kinds = {k.partition("=")[0]: "read" for k, _ in reading.read} | {k: "unused" for k, _ in reading.unused}
            kinds |= {m.group(1): "refused" for e in errors if (m := _REFUSED.match(str(e)))}
            for key in {_key_value(o)[0] for o in given}:
                readings[(kinds.get(key, "megappo's"), key)] += 1
        try:
            config_path, config_name = hydra_flags(cl.words)
            recipe = verl_config_recipe(config_path, config_name)[0] if config_name else None
            read_config(recipe, given)
        except ConfigError as e:
            errs = [line for line in str(e).splitlines() if line.strip() and not line.endswith("(each line names "
                                                                                              "its fix):")]
            refused.append((cl, errs))
            needs.update(set(need(line) for line in errs))  # each need once per line
            for line in errs:
                m = _REFUSED.match(line)
                key = m.group(1) if m else re.sub(r"^- ", "", line.strip())[:120]
                by_key[key] += 1
                fixes.setdefault(key, line.split("Fix: ", 1)[-1] if m else "")
    where = f"{args.verl_dir} {args.rev or '(work tree)'} {args.under}/"
    named = sum(1 for c in lines if hydra_flags(c.words)[1])
    print(f"{where}: {len(lines)} {args.entry} command lines in {len({c.script for c in lines})} scripts; "
          f"{len(lines) - len(refused)} read as written, {len(refused)} refused ({named} on the recipe their "
          f"--config-name names, the others on megappo's defaults)")
    for cl, errs in refused:
        print(f"\n{cl.script}")
        for line in errs:
            print(f"    {re.sub(r'^- ', '', line.strip())}")
    if any(left_out.values()):
        print("\nleft out, an empty value (a placeholder, or a variable the script does not set: named):")
        for cl in lines:
            if left_out[cl.script]:
                print(f"  {cl.script}: {' '.join(left_out[cl.script])}" + (f" (unset: {', '.join(cl.unset)})"
                                                                          if cl.unset else ""))
    print("\nwhat the refused lines need, by the number of lines:")
    for what, count in needs.most_common():
        print(f"  {count:3d} {what}")
    print("\nrefused keys, by the number of command lines:")
    for key, count in by_key.most_common():
        print(f"  {count:3d} {key}" + (f": {fixes[key][:160]}" if fixes[key] else ""))
    if args.keys:
        print("\nevery key, by the number of command lines:")
        for (kind, key), count in readings.most_common():
            print(f"  {count:3d} {kind:9s} {key}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
