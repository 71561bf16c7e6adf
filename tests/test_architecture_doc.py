"""docs/architecture.md against the code: its package tree lists exactly the packages and modules on disk,
and its layers are exactly the import-linter contract in pyproject.toml.

The tree block's format: one entry a line, indented four spaces a level under its package; a package ends
in "/", a module in ".py"; two or more spaces, then the entry's one-line description.
"""

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
CODE_ROOTS = ("models", "pipeline", "consumers")
INDENT = 4

ENTRY = re.compile(r"^(?P<indent> *)(?P<name>[A-Za-z0-9_]+(?:/|\.py))(?: {2,}(?P<description>\S.*))?$")
LAYER = re.compile(r"^[a-z_]+(?:\.[a-z_]+)*(?: \| [a-z_]+(?:\.[a-z_]+)*)*$")


def fenced_blocks(text: str) -> list[list[str]]:
    """The lines of every fenced code block of a markdown text."""
    return [block.splitlines() for block in re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)]


def tree_block() -> list[str]:
    trees = [
        b
        for b in fenced_blocks(DOC.read_text())
        if {f"{r}/" for r in CODE_ROOTS} <= {ln.split(" ")[0] for ln in b}
    ]
    assert len(trees) == 1, (
        f"{DOC.name}: expected one fenced block listing {', '.join(f'{r}/' for r in CODE_ROOTS)} at the top "
        f"level, found {len(trees)}"
    )
    return trees[0]


def parse_tree(lines: list[str]) -> dict[str, str]:
    """{path relative to the repository ("pipeline/data/", "pipeline/data/ingest.py"): its description}."""
    entries: dict[str, str] = {}
    parents: list[str] = []  # the package of each level above the current line
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        match = ENTRY.match(line)
        assert match, (
            f"{DOC.name}, tree line {number}: {line!r} is not 'NAME/' or 'NAME.py', indented by "
            f"{INDENT} spaces a level, then two spaces and a description"
        )
        indent, name = len(match["indent"]), match["name"]
        assert indent % INDENT == 0 and indent // INDENT <= len(parents), (
            f"{DOC.name}, tree line {number}: {name!r} is indented {indent} spaces; entries go {INDENT} "
            f"spaces a level, one level below their package at most"
        )
        del parents[indent // INDENT :]
        path = "".join(parents) + name
        assert match["description"], f"{DOC.name}, tree line {number}: {path} has no one-line description"
        assert path not in entries, f"{DOC.name}, tree line {number}: {path} is listed twice"
        entries[path] = match["description"]
        if name.endswith("/"):
            parents.append(name)
    return entries


def tree_on_disk() -> set[str]:
    """Every package (a folder holding .py files) and module (but __init__.py) under the code roots."""
    found = set()
    for root in CODE_ROOTS:
        for module in (ROOT / root).rglob("*.py"):
            relative = module.relative_to(ROOT)
            if "__pycache__" in relative.parts:
                continue
            found |= {"/".join(relative.parts[: i + 1]) + "/" for i in range(len(relative.parts) - 1)}
            if module.name != "__init__.py":
                found.add(relative.as_posix())
    return found


def test_the_tree_in_architecture_doc_lists_every_package_and_module_and_nothing_else():
    documented = set(parse_tree(tree_block()))
    on_disk = tree_on_disk()
    missing = sorted(on_disk - documented)
    extra = sorted(documented - on_disk)
    assert not missing and not extra, (
        f"docs/architecture.md's package tree is out of step with the code.\n"
        f"  on disk but not in the tree (add a line each): {missing}\n"
        f"  in the tree but not on disk (remove or rename): {extra}"
    )


def test_the_tree_parser_reads_nesting_and_refuses_what_it_cannot_place():
    lines = [
        "models/  the model",
        "    lstm.py  an LSTM",
        "pipeline/  batch",
        "    data/  data",
        "        io.py  io",
    ]
    assert list(parse_tree(lines)) == [
        "models/", "models/lstm.py", "pipeline/", "pipeline/data/", "pipeline/data/io.py",
    ]  # fmt: skip
    with pytest.raises(AssertionError, match="indented 8 spaces"):
        parse_tree(["models/  m", "        deep.py  two levels below its package"])
    with pytest.raises(AssertionError, match="no one-line description"):
        parse_tree(["models/  m", "    lstm.py"])
    with pytest.raises(AssertionError, match="listed twice"):
        parse_tree(["models/  m", "    lstm.py  a", "    lstm.py  b"])


def test_the_layers_in_architecture_doc_are_the_import_contract():
    blocks = [b for b in fenced_blocks(DOC.read_text()) if b and all(LAYER.match(line) for line in b)]
    assert len(blocks) == 1, (
        f"{DOC.name}: expected one fenced block of layers ('a.b | c.d' lines), found {len(blocks)}"
    )
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    assert blocks[0] == layers, (
        f"docs/architecture.md's layers differ from pyproject.toml's layers contract (top to bottom):\n"
        f"  docs:      {blocks[0]}\n  pyproject: {layers}"
    )
