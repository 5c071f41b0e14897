"""LoRA adapters: PEFT directories read and checked (adapter.py), held in numbered slots
and added per row on top of the base model's GEMMs (slots.py)."""

from engine_svc.model.lora.adapter import LoraAdapter, LoraError, read_adapter
from engine_svc.model.lora.slots import LoraSlots, NoLoraSlots

__all__ = ["LoraAdapter", "LoraError", "LoraSlots", "NoLoraSlots", "read_adapter"]
