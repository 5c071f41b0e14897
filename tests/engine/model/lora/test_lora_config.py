"""An adapter directory is untrusted input: its config and weights are checked at load.

``rank_pattern`` / ``alpha_pattern`` give each module the value PEFT gives it (the scales
read here are compared with those of the PEFT model built from the same directory, keys
that PEFT pastes into its pattern unescaped included); a key RE2 cannot take (a
look-around, a repetition past its bounds, bad syntax) is refused at once in one line
naming the directory, the file and the key; so are NaN or infinite weights, naming the
tensor, and scales or values that are not positive finite numbers.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_svc.model.arch.args import ModelArgs
from engine_svc.model.lora import LoraError, read_adapter
from engine_svc.model.lora.adapter import TARGETS
from tests.lora_factory import load_peft_model, make_adapter
from tests.model_factory import make_model_dir

# PEFT reads each key as a regular expression inside rf"(.*\.)?({key})$", matched from the
# name's start: "self_attn)|(zzz" closes that group, so it names every attention
# projection (the first branch has no "$").
RANK_PATTERN = {"self_attn)|(zzz": 4, "model.layers.1.mlp.down_proj": 2, "layers.0.mlp.(gate|up)_proj": 6}
ALPHA_PATTERN = {"o_proj": 3, "mlp\\.\\w+_proj": 5}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model_dir = make_model_dir(tmp_path_factory.mktemp("lora-config") / "model", vocab_size=256)
    return model_dir, ModelArgs.from_hf_config(json.loads((model_dir / "config.json").read_text()))


@pytest.fixture(scope="module")
def plain(model, tmp_path_factory):
    return make_adapter(model[0], tmp_path_factory.mktemp("plain") / "a", r=8, alpha=16, seed=1)


def _variant(plain, tmp_path, config: dict | None = None, weights=None):
    """A copy of ``plain`` with its config updated by ``config`` and its weights changed by ``weights``."""
    out = tmp_path / "variant"
    shutil.copytree(plain, out)
    if config is not None:
        path = out / "adapter_config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    if weights is not None:
        tensors = load_file(out / "adapter_model.safetensors")
        weights(tensors)
        save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


def test_pattern_scales_are_peft_s_own(model, tmp_path):
    model_dir, args = model
    path = make_adapter(
        model_dir, tmp_path / "p", r=8, alpha=16, rank_pattern=RANK_PATTERN, alpha_pattern=ALPHA_PATTERN
    )
    adapter = read_adapter("p", path, args, max_rank=16)
    peft_model = load_peft_model(model_dir, path)
    tensors = load_file(path / "adapter_model.safetensors")
    checked = 0
    for name, module in peft_model.named_modules():
        m = re.fullmatch(r"base_model\.model\.model\.layers\.(\d+)\.((?:self_attn|mlp)\.\w+_proj)", name)
        if m is None:
            continue
        layer, target = int(m.group(1)), m.group(2)
        ours, part = TARGETS[target]
        served = next(p for p in adapter.modules[f"layers.{layer}.{ours}"] if p.part == part)
        b = tensors[f"{name}.lora_B.weight"]
        assert served.rank == module.r["default"], name
        assert torch.equal(served.b, b * module.scaling["default"]), name
        checked += 1
    assert checked == 14
    # The key that closes PEFT's group applied to attention: rank 4 there, not the default 8.
    assert {p.rank for p in adapter.modules["layers.0.attn.qkv_proj"]} == {4}


@pytest.mark.parametrize(
    "key, reason",
    [
        ("(.|.)*(?=Z)", "invalid perl operator"),  # a look-ahead: exponential for re, not in RE2
        ("((a{1000}){1000}){1000}", "invalid repetition size"),
        ("(?:\\pL{30}){30}", "pattern too large"),  # within the repetition bound, past the memory bound
        ("q_proj(", "missing )"),
    ],
)
@pytest.mark.parametrize("field", ["rank_pattern", "alpha_pattern"])
def test_a_key_re2_cannot_take_is_refused_at_once_in_one_line(model, plain, tmp_path, field, key, reason):
    path = _variant(plain, tmp_path, {field: {"q_proj": 8, key: 8}})
    start = time.monotonic()
    with pytest.raises(LoraError) as refused:
        read_adapter("x", path, model[1], max_rank=16)
    assert time.monotonic() - start < 10  # it ended (each key costs milliseconds)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and "adapter_config.json" in message, message
    assert f"{field} key {key!r}" in message and reason in message, message


def test_a_key_that_backtracks_for_re_costs_re2_nothing(model, plain, tmp_path):
    path = _variant(plain, tmp_path, {"rank_pattern": {"(.|.)*Z": 4, "((a*)*)*b": 4}})
    start = time.monotonic()
    adapter = read_adapter("x", path, model[1], max_rank=16)
    assert time.monotonic() - start < 10 and adapter.max_rank == 8  # matched no module: the default r


@pytest.mark.parametrize(
    "config, words",
    [
        ({"rank_pattern": {f"layers.{i}.q_proj": 8 for i in range(1025)}}, "at most 1024"),  # patterns.MAX_KEYS
        ({"alpha_pattern": {"q_proj": "16"}}, "alpha_pattern key 'q_proj': the value must be a positive number"),
        ({"alpha_pattern": {"q_proj": math.inf}}, "alpha_pattern key 'q_proj': the value must be a positive number"),
        ({"lora_alpha": math.nan}, "lora_alpha must be a positive number, got nan"),
        ({"lora_alpha": 1e308}, "is not finite"),  # finite, but B times 1e308 / 8 is not
        ({"padding": "x" * (1 << 20)}, "adapter_config.json is larger than 1024 KiB"),
    ],
)
def test_values_the_engine_cannot_serve_are_refused_by_name(model, plain, tmp_path, config, words):
    path = _variant(plain, tmp_path, config)
    with pytest.raises(LoraError, match=words.replace("(", r"\(").replace(")", r"\)")) as refused:
        read_adapter("x", path, model[1], max_rank=16)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_or_infinite_weights_are_refused_naming_the_tensor(model, plain, tmp_path, value):
    name = "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"

    def spoil(tensors):
        tensors[name][3, 5] = value

    path = _variant(plain, tmp_path, weights=spoil)
    with pytest.raises(LoraError) as refused:
        read_adapter("x", path, model[1], max_rank=16)
    assert f"tensor {name} in adapter_model.safetensors holds NaN or infinite values" in str(refused.value)
    assert str(path) in str(refused.value)
