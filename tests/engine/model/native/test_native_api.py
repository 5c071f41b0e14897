"""The ctypes side of the kernels' C API against its one declaration, tandem_api.h: every
struct mirrored field for field (names, order, C types), the codes equal to the header's
enums, the argument lists short, and a build exporting the declared functions and nothing
else (the strategies' entry points stay inside the shared object)."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest
import torch

from engine_svc.model.native import KernelError, NativeKernels, api
from engine_svc.model.native import kernels as kernels_module

HEADER = re.sub(r"/\*.*?\*/", " ", api.HEADER.read_text(), flags=re.DOTALL)
MIRRORS = {
    "tk_linear": api.Linear,
    "tk_lora": api.LoraTerm,
    "tk_attn_shape": api.AttnShape,
    "tk_decode_rows": api.DecodeRows,
    "tk_prefill_chunks": api.PrefillChunks,
    "tk_layer": api.Layer,
    "tk_stack_shape": api.StackShape,
}


def _header_structs() -> dict[str, list[tuple[str, type]]]:
    """{typedef name: [(field, ctypes type)]} of the header's structs: a pointer is c_void_p,
    a struct its mirror (declarations such as ``const int32_t *rows, *starts`` split)."""
    structs = {}
    for body, name in re.findall(r"typedef struct(?: \w+)? \{(.*?)\} (\w+);", HEADER, flags=re.DOTALL):
        fields: list[tuple[str, type]] = []
        for declaration in filter(None, (d.strip() for d in body.split(";"))):
            first, *others = declaration.split(",")
            base = first.replace("*", " ").split()[-2]
            for declarator in (first, *others):
                field = declarator.replace("*", " ").split()[-1]
                ctype = ctypes.c_void_p if "*" in declarator else MIRRORS.get(base) or api.C_TYPES[base]
                assert ctype is not None
                fields.append((field, ctype))
        structs[name] = fields
    return structs


def test_every_struct_is_mirrored_field_for_field():
    structs = _header_structs()
    assert structs.keys() == MIRRORS.keys()
    for name, mirror in MIRRORS.items():
        assert [(f[0], f[1]) for f in mirror._fields_] == structs[name], name


def test_codes_are_the_headers_enums():
    enums = {name: int(value) for name, value in re.findall(r"\b(TK_\w+) = (\d+)", HEADER)}
    assert enums["TK_F32"] == api.DTYPE_CODES[torch.float32] == api.SCALE_CODES[torch.float32]
    assert enums["TK_BF16"] == api.DTYPE_CODES[torch.bfloat16]
    assert enums["TK_F16"] == api.SCALE_CODES[torch.float16]
    assert (enums["TK_EPI_NONE"], enums["TK_EPI_SILU_MUL"]) == (api.EPILOGUE_NONE, api.EPILOGUE_SILU_MUL)


def test_signatures_are_read_from_the_header_and_no_list_runs_long():
    """What is fixed for a layer or a model goes in a struct; no kernel takes more than ten
    arguments."""
    sigs = api.SIGNATURES
    assert sigs["tk_gemm_pack"] == (None, [ctypes.c_void_p, *[ctypes.c_int] * 4, ctypes.c_void_p, ctypes.c_int])
    assert sigs["tk_qgemm"][1][:3] == [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long]
    assert sigs["tk_api_version"] == (ctypes.c_int, [])
    assert len(sigs) == len(re.findall(r"\btk_\w+\s*\(", HEADER))  # every prototype read
    assert max(len(argtypes) for _, argtypes in sigs.values()) <= 10


def test_a_build_exports_the_declared_functions_alone(kernels):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("needs nm")
    out = subprocess.run([nm, "-D", "--defined-only", str(kernels.path)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in out.stdout.splitlines() if line.split()[1] == "T"}
    assert exported == set(api.SIGNATURES)


def test_a_build_of_another_api_is_refused(kernels, monkeypatch):
    monkeypatch.setattr(kernels_module, "API_VERSION", api.API_VERSION + 1)
    with pytest.raises(KernelError, match=f"C API {api.API_VERSION}, these bindings are for {api.API_VERSION + 1}"):
        NativeKernels(kernels.path, kernels.isa)
