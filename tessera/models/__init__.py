"""Reference models (and, later, per-family parallelism policies)."""

from tessera.models.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
