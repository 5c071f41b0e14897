"""PEFT LoRA adapters for tests and benchmarks, made with ``peft`` on a random-weight model.

``init_lora_weights=False`` draws B at random too (PEFT's default sets B to zero, which
makes a fresh adapter an identity and would prove nothing); the B draw is scaled up so
the adapter changes greedy outputs of a model with initializer_range 0.1.
"""

from __future__ import annotations

from pathlib import Path

import torch

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    r: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ALL_TARGETS,
    use_rslora: bool = False,
    seed: int = 0,
    b_scale: float = 8.0,
    rank_pattern: dict | None = None,
    alpha_pattern: dict | None = None,
) -> Path:
    """Write a PEFT adapter for the model in ``model_dir`` into ``out_dir``; returns it."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(b_scale)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


def load_peft_model(model_dir: str | Path, adapter_dir: str | Path):
    """transformers' model with the adapter applied by PEFT itself (the reference)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
