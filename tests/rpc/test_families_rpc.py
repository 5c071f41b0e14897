"""One model of each family through the real pair (engine and frontend subprocesses on
127.0.0.1): token-id prompts over the public API, greedy ids equal to transformers."""

from __future__ import annotations

import shutil

import grpc
import pytest
import torch
import transformers

from tests.family_factory import FAMILIES, make_family_dir
from tests.rpc.frontend_calls import generate, ids_of, stub_of
from tests.services import running_pair

NUM_NEW = 6
PROMPTS = [[5, 9, 17], list(range(3, 60)), [40 + (7 * i) % 200 for i in range(90)]]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.mark.parametrize("family", list(FAMILIES))
async def test_family_over_grpc_matches_transformers(family, demo_model_dir, tmp_path):
    path = make_family_dir(tmp_path / "model", family)
    for name in TOKENIZER_FILES:  # the frontend needs a tokenizer; the prompts are ids below the vocab
        if (demo_model_dir / name).is_file():
            shutil.copy(demo_model_dir / name, path / name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine_args = ("--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256")
    with running_pair(path, *engine_args) as (_, frontend):
        async with grpc.aio.insecure_channel(frontend.address) as channel:
            stub = stub_of(channel)
            for prompt in PROMPTS:
                params = dict(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)
                ours = ids_of(await generate(stub, token_ids=prompt, params=params))
                with torch.inference_mode():
                    out = hf.generate(
                        torch.tensor([prompt]), max_new_tokens=NUM_NEW, min_new_tokens=NUM_NEW, do_sample=False
                    )
                assert ours == out[0, len(prompt) :].tolist(), (family, len(prompt))
