"""The C heap keeps a step's freed activations for the next step (served.keep_step_buffers)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# A decoder step's allocations in miniature: per layer, GEMM outputs of a few MiB with
# overlapping lives, all freed by the step's end; then the same again, step after step.
SCRIPT = """
import json, resource, torch
from engine_svc.model.load.served import keep_step_buffers

MiB = 1 << 20

def buf(mib):
    return torch.empty(int(mib * MiB), dtype=torch.uint8).fill_(1)

def step():
    x = buf(2.4)
    for _ in range(8):
        qkv = buf(3.9)
        attn = buf(2.4)
        del qkv
        o = buf(2.4)
        del attn
        h = buf(2.4)
        gate_up = buf(6.3)
        del h, o
        x = buf(2.4)
        del gate_up

def faults_of_steps():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        step()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

faults_of_steps()  # the first steps, with the default settings
default = faults_of_steps()
kept = keep_step_buffers()
faults_of_steps()  # the heap grows to the steps' size once
print(json.dumps({"default": default, "kept": kept, "after": faults_of_steps()}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_steps_freed_buffers_are_reused_without_page_faults():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    assert figures["kept"] is True
    # glibc's defaults unmap or trim what a step frees, and the next step faults it back in
    assert figures["default"] > 2000
    assert figures["after"] < figures["default"] // 5
