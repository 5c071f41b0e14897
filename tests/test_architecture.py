"""The architecture's rules, held by tools: import contracts, lint and format, types.

Each test runs the real tool over the tree, as a contributor would before a commit:
    .venv/bin/lint-imports          contracts in pyproject.toml [tool.importlinter]
    .venv/bin/ruff check . && .venv/bin/ruff format --check .
    .venv/bin/clang-format --dry-run --Werror <the C sources>     layout in .clang-format
    .venv/bin/mypy                  files and strictness in pyproject.toml [tool.mypy]
and one rule no contract states for the whole tree: no import circle, benchmarks and
tests included.
"""

from __future__ import annotations

import graphlib
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# Every hand-written package of the tree (tandem_protos is generated).
PACKAGES = ("engine_svc", "frontend_svc", "tandem_common", "benchmarks", "tests")


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: it is part of the test extras (pip install -e '.[test]')")
    return found


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_import_contracts_hold():
    result = _run(_tool("lint-imports"), "--no-cache")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_lint_is_clean():
    result = _run(_tool("ruff"), "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    result = _run(_tool("ruff"), "format", "--check", ".")
    assert result.returncode == 0, "run `ruff format .`:\n" + result.stdout + result.stderr


def test_clang_format_is_clean():
    """The native kernels' C in .clang-format's layout, as ruff holds the Python's."""
    sources = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "engine_svc").rglob("*.[ch]"))
    assert sources, "no C sources found"
    result = _run(_tool("clang-format"), "--dry-run", "--Werror", *sources)
    assert result.returncode == 0, "run `clang-format -i` on them:\n" + result.stdout + result.stderr


def test_mypy_is_clean():
    result = _run(_tool("mypy"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_module_imports_itself_through_others():
    """Module by module, imports made only for type checking included: a circle there
    still ties the modules together for a reader and for the next refactoring."""
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)
    sorter = graphlib.TopologicalSorter({m: graph.find_modules_directly_imported_by(m) for m in graph.modules})
    try:
        sorter.prepare()
    except graphlib.CycleError as e:
        pytest.fail("import circle: " + " -> ".join(e.args[1]))
