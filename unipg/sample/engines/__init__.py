"""Inference engines behind the inference service: ``hf`` (the policy's own batching sampler) and ``vllm``.

Registering happens on import; vLLM itself is imported only when a ``vllm`` engine is built.
"""

from unipg.sample.engines import hf, vllm  # noqa: F401  (register the engines)
from unipg.sample.engines.base import ENGINES, Engine, SamplingParams, TurnOutput

__all__ = ["ENGINES", "Engine", "SamplingParams", "TurnOutput"]
