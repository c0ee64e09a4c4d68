"""A self-contained LLM inference engine. Public names only."""
import os

# oneDNN caches one primitive (with its scratch memory) per linear-layer shape, and a serving
# engine sees a new token count almost every step. Its default capacity (1024) lets that cache
# grow by hundreds of MiB under varied load; 128 keeps it small at no measurable speed cost.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "128")
from engine.config import EngineConfig
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # LLM lives in entrypoints (it drives the engine); imported lazily to keep imports pointing down.
    if name == "LLM":
        from entrypoints.llm import LLM
        return LLM
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
