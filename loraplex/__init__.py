"""loraplex: multi-LoRA serving over one base model."""

from loraplex.lora.spec import LoRARequest
from loraplex.beam_search import BeamSearchOutput, BeamSearchParams
from loraplex.sampling_params import InvalidRequestError, SamplingParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "BeamSearchOutput", "InvalidRequestError", "AsyncLLMEngine", "LoRARequest"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Lazy: `import loraplex` must not import torch (the scheduler and CLI stay light).
    if name == "LLM":
        from loraplex.engine.llm import LLM

        return LLM
    if name == "AsyncLLMEngine":
        from loraplex.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)
