"""Every key of `tpu_keras.config.defaults()`, its default and what it does: the reference
section of docs/configuration.md, written from the schema's own source and comments.

    python scripts/config_reference.py           # rewrites the section
    python scripts/config_reference.py --check   # exit 1 if the section is out of date

A key's text is its own comment in `defaults()`: the comment at the end of its
line, or else the comment lines right above it. A section's text is the
comment above its assignment. The values come from `defaults()` itself, so
the table cannot drift from the schema; a key without a comment is an error
here, so the schema cannot grow a key nobody explained.
"""

import argparse
import ast
import io
import os
import sys
import tokenize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tpu_keras import config as config_lib  # noqa: E402

SOURCE = os.path.join(REPO, "tpu_keras", "config.py")
DOCUMENT = os.path.join(REPO, "docs", "configuration.md")
BEGIN, END = "<!-- reference: scripts/config_reference.py -->", "<!-- reference end -->"


def comments_by_line(source: str, lines: list) -> tuple[dict, dict]:
    """({line: text} of whole-line comments, {line: text} of comments after code)."""
    whole, trailing = {}, {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            row = token.start[0]
            text = token.string.lstrip("#").strip()
            (whole if not lines[row - 1][:token.start[1]].strip() else trailing)[row] = text
    return whole, trailing


def _above(line: int, whole: dict) -> str:
    """The run of whole-line comments ending just above `line`."""
    texts = []
    while line - 1 in whole:
        line -= 1
        texts.insert(0, whole[line])
    return " ".join(texts)


def described_keys() -> dict:
    """{'section.key' or 'key': text} for every key and section `defaults()` assigns."""
    with open(SOURCE) as file:
        source = file.read()
    lines = source.splitlines()
    whole, trailing = comments_by_line(source, lines)
    function = next(node for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.FunctionDef) and node.name == "defaults")
    texts = {}

    def text_of(line: int, name: str) -> str:
        """The comment at the end of `line`, or above it where `name` starts the line."""
        if line in trailing:
            return trailing[line]
        return _above(line, whole) if lines[line - 1].lstrip().startswith(name) else ""

    def visit(value, prefix: str):
        if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "dict":
            for keyword in value.keywords:
                key = f"{prefix}.{keyword.arg}"
                texts[key] = text_of(keyword.lineno, keyword.arg)
                visit(keyword.value, key)

    for statement in function.body:
        if isinstance(statement, ast.Assign) and isinstance(statement.targets[0], ast.Attribute):
            name = statement.targets[0].attr
            texts[name] = text_of(statement.lineno, "config.")
            visit(statement.value, name)
    return texts


def _value(schema, path: str):
    for key in path.split("."):
        schema = schema[key]
    return schema


def reference() -> str:
    """The reference section's markdown, in the order `defaults()` gives the keys."""
    texts, schema = described_keys(), config_lib.defaults()
    missing = [path for path in _paths(schema) if not texts.get(path)]
    unknown = sorted(set(texts) - set(_paths(schema)))
    if missing or unknown:
        raise SystemExit(f"error: tpu_keras/config.py's defaults() has no comment for "
                         f"{', '.join(missing) or 'none'} and keys this script misread: "
                         f"{', '.join(unknown) or 'none'}; give each key a comment on its line "
                         "or above it")
    table = ["| key | default | what it does |", "| --- | --- | --- |"]

    def row(path: str, value) -> str:
        if _holds_keys(value):  # a part inside a section: a row of its own, its keys below
            return f"| `{path}` | | {_cell(texts[path])} |"
        value = value.to_dict() if hasattr(value, "to_dict") else value  # an empty dict's default
        return f"| `{path}` | `{_cell(repr(value))}` | {_cell(texts[path])} |"

    values = {path: _value(schema, path) for path in texts}
    sections = [path for path, value in values.items() if "." not in path and _holds_keys(value)]
    out = ["Every key of `defaults()`, with its default. The text is the schema's own",
           "comment (`tpu_keras/config.py`); `python scripts/config_reference.py` writes",
           "this section from it, and a test fails when a key has no line here.", "",
           "### Top level", "", *table]
    out += [row(path, value) for path, value in values.items() if "." not in path and path not in sections]
    for section in sections:
        out += ["", f"### `{section}`", "", texts[section], "", *table]
        out += [row(path, value) for path, value in values.items() if path.startswith(section + ".")]
    return "\n".join(out) + "\n"


def _holds_keys(value) -> bool:
    return hasattr(value, "items") and len(value) > 0


def _paths(section, prefix=""):
    for key, value in section.items():
        yield f"{prefix}{key}"
        if hasattr(value, "items"):
            yield from _paths(value, f"{prefix}{key}.")


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def written(document: str) -> str:
    """`document` with its reference section replaced."""
    start, end = document.index(BEGIN) + len(BEGIN), document.index(END)
    return document[:start] + "\n" + reference() + document[end:]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the section is out of date")
    arguments = parser.parse_args()
    with open(DOCUMENT) as file:
        current = file.read()
    wanted = written(current)
    if arguments.check:
        if wanted != current:
            raise SystemExit("error: docs/configuration.md's reference is out of date; run "
                             "python scripts/config_reference.py")
    elif wanted != current:
        with open(DOCUMENT, "w") as file:
            file.write(wanted)
