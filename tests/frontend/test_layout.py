"""The frontend's parts keep their nevers (see frontend_svc/*/__init__.py).

The text side and request planning load neither grpc nor protobuf, even indirectly, and
the generated code is imported only at the two protobuf boundaries: the engine protocol
(engine/convert.py, engine/client.py) and the public API (service/convert.py,
service/servicer.py).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "frontend_svc"

PROTO_BOUNDARY = {"engine/client.py", "engine/convert.py", "service/convert.py", "service/servicer.py"}


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_only_the_boundaries_import_generated_code():
    importers = {
        str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
        if any(name.split(".")[0] == "tandem_protos" for name in _imported(path))
    }
    assert importers == PROTO_BOUNDARY


@pytest.mark.parametrize("module", [
    "frontend_svc.text.tokenizer", "frontend_svc.text.detokenizer", "frontend_svc.text.stop_checker",
    "frontend_svc.text.output_processor", "frontend_svc.engine.types", "frontend_svc.engine.handle",
    "frontend_svc.service.planning",
])
def test_plain_modules_load_no_grpc_or_protobuf(module):
    probe = (f"import sys, {module}; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'tandem_protos') "
             "or m.startswith('google.protobuf')))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]", loaded.stdout
