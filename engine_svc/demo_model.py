"""The built-in demo model: a tiny random-weight Llama that is built locally, in seconds.

It lets a newcomer start the engine + frontend pair with one command on a machine with no
model files and no network. It is also the model the tests use. The output is gibberish
by design; what matters is that it exercises every part of the serving path for real:

* a Llama-architecture checkpoint (GQA, RoPE, SwiGLU, untied lm_head) in float32
  safetensors, loadable by ``transformers.AutoModelForCausalLM`` as ``LlamaForCausalLM``,
  so the engine's loader and the ``transformers`` reference read the same bytes;
* a byte-level BPE tokenizer (~2k tokens) trained on ``demo_corpus.txt``, which ships
  next to this file, with Llama-3-style special tokens and a ChatML chat template;
* weights drawn with a large scale (std 0.15), so greedy decoding wanders over many
  tokens instead of repeating one, which makes stop strings, detokenization and
  streaming visible in demos and tests.

Layout of the built directory (the same as a Hugging Face checkpoint)::

    demo-model-v1/
      config.json  generation_config.json  model.safetensors
      tokenizer.json  tokenizer_config.json  special_tokens_map.json  chat_template.jinja
      tandem_demo.json        <- written last: the directory is complete

Builds are deterministic: the same library versions give the same bytes every time (the
tokenizer trainer is deterministic, and the weights come from a private
``torch.Generator`` with a fixed seed, so neither the caller's global RNG nor a concurrent
build in another thread can change them, and the build leaves the global RNG untouched).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path

from tandem_common.cache import cache_dir

logger = logging.getLogger(__name__)

DEMO_MODEL_NAME = "tandem-demo-v1"
# Bump the folder name whenever the recipe below changes, so stale caches are not reused.
DEMO_MODEL_DIR_NAME = "demo-model-v1"

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# Total vocabulary including the special tokens. A multiple of 64 and exactly the
# tokenizer's size, so the model can never emit an id the tokenizer cannot decode.
VOCAB_SIZE = 2048
MAX_MODEL_LEN = 2048
# Large on purpose: with transformers' default of 0.02, greedy decoding of this model
# falls into loops of a few tokens; from 0.1 up, 32 greedy tokens are nearly all distinct.
INITIALIZER_RANGE = 0.15
SEED = 1234

# Shapes of the demo Llama. Small enough to build and run in seconds on a laptop CPU,
# big enough to have real GQA (4 query heads share 2 KV heads) and several layers.
MODEL_SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}

# ChatML. The template writes the BOS itself (as Llama 3's does), so text rendered from
# it must be tokenized with add_special_tokens=False, which is what
# ``apply_chat_template(tokenize=True)`` does.
CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- for message in messages %}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "{{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

_CORPUS_PATH = Path(__file__).with_name("demo_corpus.txt")
_STAMP_FILE = "tandem_demo.json"
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    _STAMP_FILE,
)
# Serialises builds inside one process; across processes the final rename decides.
_build_lock = threading.Lock()


def default_demo_model_dir() -> Path:
    """``demo-model-v1/`` in Tandem's cache directory (``tandem_common.cache.cache_dir``)."""
    return cache_dir() / DEMO_MODEL_DIR_NAME


def ensure_demo_model() -> Path:
    """Return the cached demo model directory, building it on first use.

    Safe to call from many threads and processes at once: each builder writes into its
    own temporary directory and renames it into place; every caller gets a complete
    directory (at worst two processes both spend the couple of seconds a build takes).
    """
    return build_demo_model(default_demo_model_dir())


def is_demo_model_dir(path: str | Path) -> bool:
    """True when ``path`` holds a complete demo model build."""
    path = Path(path)
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def build_demo_model(out_dir: str | Path, *, force: bool = False) -> Path:
    """Build the demo model into ``out_dir`` and return it.

    Without ``force``, a complete build already at ``out_dir`` is returned untouched and a
    non-empty directory holding anything else is an error. With ``force`` the directory is
    replaced. The directory appears atomically: it is written next to ``out_dir`` under a
    temporary name, then renamed.
    """
    out = Path(out_dir).expanduser().absolute()
    # The lock makes a second thread of this process wait and then find the finished
    # build; other processes are handled by the rename in _install.
    with _build_lock:
        if not force:
            if is_demo_model_dir(out):
                return out
            if out.exists() and (not out.is_dir() or any(out.iterdir())):
                raise FileExistsError(f"{out} exists and is not a demo model build; use force=True")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            _write_demo_model(tmp)
            _install(tmp, out, force=force)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _install(tmp: Path, out: Path, *, force: bool) -> None:
    """Move the finished build ``tmp`` to ``out``; losing a race to another builder is fine."""
    if force and out.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    try:
        out.rmdir()  # an empty placeholder directory (e.g. made by the caller)
    except OSError:
        pass
    try:
        os.rename(tmp, out)
        logger.info("built the demo model in %s", out)
    except OSError:
        # Another process or thread installed its build first: same bytes, keep theirs.
        if not is_demo_model_dir(out):
            raise


def _write_demo_model(out: Path) -> None:
    tokenizer = _train_tokenizer()
    if tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(f"{_CORPUS_PATH.name} is too small for a {VOCAB_SIZE}-token vocabulary")
    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    _write_tokenizer_files(tokenizer, special_ids, out)
    _write_model(special_ids, out)
    # mkdtemp makes the directory 0700 and safetensors writes 0600; give the cache the
    # modes of an ordinary download so another user (or container uid) can read it.
    for path in out.iterdir():
        path.chmod(0o644)
    out.chmod(0o755)
    _write_json(out / _STAMP_FILE, {"dir_name": DEMO_MODEL_DIR_NAME, "name": DEMO_MODEL_NAME})


# ---------------------------------------------------------------------------- tokenizer


def _train_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _CORPUS_PATH.read_text(encoding="utf-8").splitlines()
    tokenizer.train_from_iterator(lines, trainer=trainer)
    # Added after training, so they take the last ids (as in Llama 3) and the trained
    # ids stay dense from 0.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN}:0 $A:0",
                pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def _write_tokenizer_files(tokenizer, special_ids: dict[str, int], out: Path) -> None:
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)

    def token_entry(content: str) -> dict:
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False}

    tokenizer_config = {
        "add_bos_token": True,  # the post-processor adds BOS to every encoded prompt
        "add_eos_token": False,
        "added_tokens_decoder": {str(special_ids[t]): {**token_entry(t), "special": True} for t in SPECIAL_TOKENS},
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MAX_MODEL_LEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(
        out / "special_tokens_map.json",
        {"bos_token": token_entry(BOS_TOKEN), "eos_token": token_entry(EOS_TOKEN)},
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


# -------------------------------------------------------------------------------- model


def demo_model_config(special_ids: dict[str, int]) -> dict:
    """config.json, with the keys ``transformers`` writes for ``LlamaConfig``.

    Both RoPE spellings are present: ``rope_parameters`` (transformers 5) and the flat
    ``rope_theta`` (transformers 4 and most other readers); likewise ``dtype`` and
    ``torch_dtype``.
    """
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **MODEL_SHAPE,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_MODEL_LEN,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "initializer_range": INITIALIZER_RANGE,
        "tie_word_embeddings": False,
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": special_ids[EOS_TOKEN],
        "pad_token_id": None,
        "use_cache": True,
        "dtype": "float32",
        "torch_dtype": "float32",
    }


def _write_model(special_ids: dict[str, int], out: Path) -> None:
    """config.json, generation_config.json and model.safetensors.

    The checkpoint is written directly (the same tensor names, shapes and safetensors
    metadata as ``LlamaForCausalLM.save_pretrained``) rather than through transformers:
    importing transformers' model code costs several seconds, far more than the whole
    build, and the engine does not otherwise need it. The tests load the result with
    ``AutoModelForCausalLM`` and check that no weight is missing or unexpected.
    """
    import torch
    from safetensors.torch import save_file

    config = demo_model_config(special_ids)
    eos_id = special_ids[EOS_TOKEN]
    generation_config = {
        "bos_token_id": special_ids[BOS_TOKEN],
        # A chat turn ends with <|im_end|>, plain text with <|end_of_text|>.
        "eos_token_id": [eos_id, special_ids[IM_END_TOKEN]],
        "pad_token_id": eos_id,
    }
    shapes = _weight_shapes(config)
    generator = torch.Generator().manual_seed(SEED)
    tensors = {}
    for name in sorted(shapes):  # a fixed draw order makes the bytes reproducible
        if len(shapes[name]) == 1:
            tensors[name] = torch.ones(shapes[name], dtype=torch.float32)  # RMSNorm gains
        else:
            tensors[name] = torch.empty(shapes[name], dtype=torch.float32).normal_(
                0.0, INITIALIZER_RANGE, generator=generator
            )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config)


def _weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Hugging Face Llama parameter names -> shapes (Linear weights are [out, in])."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    vocab = config["vocab_size"]
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (vocab, hidden),
    }
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.self_attn.q_proj.weight": (q_dim, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_dim, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
        }
    return shapes


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n", encoding="utf-8")
