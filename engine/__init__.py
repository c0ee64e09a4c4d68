"""A self-contained LLM inference engine. Public names only."""
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
