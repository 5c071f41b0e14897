"""Docstrings and comments name only code that exists: a rename or a removal that leaves a
backticked reference to the old name behind fails here.

Checked, because they can be resolved without guessing (each in backticks):
* Class.member, where the class is defined in the tree (and all its bases are too, and
  no protobuf message has its name): the member is defined or assigned in the class or
  one of its bases;
* package.module.name under one of our packages: the module exists and defines or
  imports the name (or it is a submodule);
* a private function called by name, with parentheses: a function or class of that name
  exists in the tree;
* a file named by its path (``engine_svc/model/runner.py``, ``spec/layout.py``) or by its
  name alone (``watchdog.py``): a file in the tree has that path, or ends with it.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine_svc", "frontend_svc", "tandem_common", "tests", "benchmarks", "tools")
_DOTTED = re.compile(r"``?([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)+)(?:\(\))?``?")
_PRIVATE_CALL = re.compile(r"``?(_[a-z]\w*)\(\)``?")
_MESSAGE = re.compile(r"\b(?:message|enum)\s+(\w+)")
# A source or document file of the tree: a word, optionally after folders, with one of these suffixes.
# Files of other projects the text cites (llama.cpp's converter, glibc's header, PEFT's module table).
OUTSIDE_FILES = {"convert_hf_to_gguf.py", "malloc.h", "peft/utils/other.py"}
_FILE = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[A-Za-z_][\w-]*\.(?:py|c|h|proto|md|yaml|jsonl|toml))(?![\w/])")


def _sources() -> list[Path]:
    files = [ROOT / "tandem_cli.py"]
    for package in PACKAGES:
        files += sorted((ROOT / package).rglob("*.py"))
    return [f for f in files if "node_modules" not in f.parts]


def _texts(tree: ast.Module, source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every docstring and comment."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield getattr(node.body[0], "lineno", 1), doc
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


class _Tree:
    def __init__(self) -> None:
        self.modules: dict[str, set[str]] = {}  # dotted module -> names it defines or imports
        self.classes: dict[str, tuple[set[str], list[str]]] = {}  # class -> (members, base names)
        self.callables: set[str] = set()
        self.messages = {m for p in ROOT.glob("protos/**/*.proto") for m in _MESSAGE.findall(p.read_text())}
        self.parsed: list[tuple[Path, ast.Module, str]] = []
        self.files = {
            p.relative_to(ROOT).as_posix()
            for p in ROOT.rglob("*")
            if p.is_file() and not {"node_modules", ".git", ".venv"} & set(p.relative_to(ROOT).parts)
        }
        for path in _sources():
            source = path.read_text()
            tree = ast.parse(source)
            self.parsed.append((path, tree, source))
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            self.modules[module] = _top_level_names(tree)
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.callables.add(node.name)
                if isinstance(node, ast.ClassDef):
                    bases = [b.id if isinstance(b, ast.Name) else "?" for b in node.bases]
                    self.classes[node.name] = (_members(node), bases)

    def has_file(self, path: str) -> bool:
        return path in OUTSIDE_FILES or path in self.files or any(f.endswith("/" + path) for f in self.files)

    def has_member(self, cls: str, member: str, depth: int = 0) -> bool | None:
        """True / False, or None when a base lies outside the tree (cannot tell)."""
        members, bases = self.classes[cls]
        if member in members:
            return True
        answers = [self.has_member(b, member, depth + 1) if b in self.classes and depth < 8 else None for b in bases]
        if any(a is True for a in answers):
            return True
        return None if any(a is None for a in answers) else False

    def resolves(self, dotted: str) -> bool:
        parts = dotted.split(".")
        for cut in range(len(parts), 0, -1):
            module = ".".join(parts[:cut])
            if module in self.modules:
                rest = parts[cut:]
                if not rest:
                    return True
                name = rest[0]
                if name in self.modules[module] or f"{module}.{name}" in self.modules:
                    return len(rest) == 1 or name not in self.classes or self.has_member(name, rest[1]) is not False
                return False
        return parts[0] not in PACKAGES  # not ours: a path, a file name, a protobuf package


def _top_level_names(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):  # conditional and try/except definitions count too
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    return names


def _members(cls: ast.ClassDef) -> set[str]:
    members: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            members.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            members.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            members.add(node.attr)
    return members


def test_docstrings_and_comments_name_code_that_exists():
    tree = _Tree()
    stale = []
    for path, module, source in tree.parsed:
        for line, text in _texts(module, source):
            where = f"{path.relative_to(ROOT)}:{line}"
            for dotted in _DOTTED.findall(text):
                head, member = dotted.split(".")[0], dotted.split(".")[1]
                if head in tree.classes and head not in tree.messages and tree.has_member(head, member) is False:
                    stale.append(f"{where}: {dotted}")
                elif head in PACKAGES and not tree.resolves(dotted):
                    stale.append(f"{where}: {dotted}")
            stale += [f"{where}: {name}()" for name in _PRIVATE_CALL.findall(text) if name not in tree.callables]
            stale += [f"{where}: {name}" for name in _FILE.findall(text) if not tree.has_file(name)]
    assert not stale, "docstrings or comments name code that does not exist:\n" + "\n".join(stale)
