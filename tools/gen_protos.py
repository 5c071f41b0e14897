"""Regenerate the Python protobuf/gRPC code in tandem_protos/ from protos/.

    python tools/gen_protos.py            # rewrite tandem_protos/
    python tools/gen_protos.py --out DIR  # write elsewhere (the up-to-date test uses this)

Generated modules import each other by proto package path (``tandem.engine.v1``); they
live under the ``tandem_protos`` package, so those imports are rewritten to match.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
PACKAGE = "tandem_protos"
_IMPORT_RE = re.compile(r"^from tandem\.", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # imported here: only needed when regenerating

    with tempfile.TemporaryDirectory() as tmp:
        include = Path(protoc.__file__).parent / "_proto"
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
        (out_dir / "__init__.py").write_text(
            '"""Generated protobuf and gRPC code; regenerate with tools/gen_protos.py."""\n'
        )
        for src in sorted(Path(tmp).rglob("*")):
            rel = src.relative_to(tmp)
            dst = out_dir / rel
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
                (dst / "__init__.py").write_text("")
                continue
            text = _IMPORT_RE.sub(f"from {PACKAGE}.tandem.", src.read_text())
            dst.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / PACKAGE)
    args = parser.parse_args(argv)
    generate(args.out)
    print(f"generated {len(proto_files())} proto files into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
