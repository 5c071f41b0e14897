"""Model definitions and weight loading: the Llama family (Llama, Mistral, Qwen2)."""

from engine_svc.models.llama import SUPPORTED_ARCHITECTURES, ModelArgs, Transformer
from engine_svc.models.loader import load_model, read_special_token_ids

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelArgs", "Transformer", "load_model", "read_special_token_ids"]
