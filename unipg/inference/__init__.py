"""Who generates: the inference engines (``hf``, the policy's own batching sampler, and ``vllm``) behind the
inference service, and the OpenAI-compatible endpoint (``unipg.inference.endpoint``).

``HFService`` is the ``hf`` engine's service (dynamic batching of ``LMPolicy.sample``); ``TurnOutput`` and
``SamplingParams`` are shared by every engine. Registering happens on import; vLLM itself is imported only when a
``vllm`` engine is built.
"""

from unipg.inference import hf, vllm_roles  # noqa: F401  (register the engines: hf, and vllm with its roles)
from unipg.inference.base import ENGINES, Engine, SamplingParams, TurnOutput
from unipg.inference.hf import HFService

__all__ = ["ENGINES", "Engine", "HFService", "SamplingParams", "TurnOutput"]
