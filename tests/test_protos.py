"""The .proto contracts: buf lint/format clean, generated code current and importable."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"


def _buf() -> str:
    exe = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    if not Path(exe).exists():
        pytest.fail("buf is not installed: install the test extra (pip install -e '.[test]')")
    return exe


def test_buf_lint_clean():
    result = subprocess.run([_buf(), "lint"], cwd=PROTOS, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_buf_format_clean():
    result = subprocess.run([_buf(), "format", "--exit-code", "--diff"], cwd=PROTOS, capture_output=True, text=True)
    assert result.returncode == 0, "run `buf format -w` in protos/:\n" + result.stdout + result.stderr


# protoc stamps its own version into the generated code; a different patch release of
# grpcio-tools is not a stale contract.
_VERSION_LINES = re.compile(r"^(# Protobuf Python Version: .*|\s+\d+,)$|GRPC_GENERATED_VERSION = .*", re.MULTILINE)


def _normalised(path: Path) -> str:
    return _VERSION_LINES.sub("", path.read_text())


def test_generated_code_is_current(tmp_path):
    out = tmp_path / "tandem_protos"
    subprocess.run([sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--out", str(out)], check=True)
    fresh = {p.relative_to(out): p for p in out.rglob("*") if p.is_file()}
    committed = {
        p.relative_to(ROOT / "tandem_protos"): p
        for p in (ROOT / "tandem_protos").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert set(fresh) == set(committed), "run `python tools/gen_protos.py` and commit tandem_protos/"
    stale = [str(rel) for rel, p in fresh.items() if _normalised(p) != _normalised(committed[rel])]
    assert not stale, f"generated code is out of date ({stale}): run `python tools/gen_protos.py`"


def test_generated_code_imports():
    from tandem_protos.tandem.engine.v1 import engine_pb2, engine_pb2_grpc
    from tandem_protos.tandem.generate.v1 import generate_pb2, generate_pb2_grpc

    assert engine_pb2.DESCRIPTOR.services_by_name["EngineService"].methods_by_name["Stream"].client_streaming
    assert generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].methods_by_name["Generate"].server_streaming
    assert engine_pb2_grpc.EngineServiceStub and generate_pb2_grpc.GenerateServiceStub


def test_every_message_and_field_is_commented():
    """Other-language clients read only the .proto, so nothing may go undocumented."""
    missing = []
    for path in PROTOS.rglob("*.proto"):
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            s = line.strip()
            declares = re.match(r"(message|enum|service|rpc|oneof)\s+\w+", s) or re.match(
                r"(optional |repeated )?[\w.<>, ]+\s+\w+\s*=\s*\d+;", s
            )
            if declares and not lines[i - 1].strip().startswith("//"):
                missing.append(f"{path.name}:{i + 1}: {s}")
    assert not missing, "undocumented declarations:\n" + "\n".join(missing)
