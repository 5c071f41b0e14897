"""Both services start as subprocesses and answer the real grpcurl through reflection alone."""

from __future__ import annotations

import json

from tests.grpcurl import grpcurl


def _check(address: str, service: str) -> None:
    listed = grpcurl("-plaintext", address, "list").split()
    assert {"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", service} <= set(listed)
    described = grpcurl("-plaintext", address, "describe", service)
    assert f"service {service.rsplit('.', 1)[1]}" in described
    health = json.loads(grpcurl("-plaintext", address, "grpc.health.v1.Health/Check"))
    assert health == {"status": "SERVING"}
    named = json.loads(
        grpcurl("-plaintext", "-d", json.dumps({"service": service}), address, "grpc.health.v1.Health/Check")
    )
    assert named == {"status": "SERVING"}


def test_grpcurl_sees_both_services(pair):
    engine, frontend = pair
    _check(engine.address, "tandem.engine.v1.EngineService")
    _check(frontend.address, "tandem.generate.v1.GenerateService")


def test_help_of_every_command():
    import subprocess
    import sys
    from pathlib import Path

    bindir = Path(sys.executable).parent
    for cmd, needle in [
        ("tandem-engine", "--max-num-batched-tokens"),
        ("tandem-frontend", "--engine"),
        ("tandem", "serve"),
    ]:
        exe = bindir / cmd
        result = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert needle in result.stdout
