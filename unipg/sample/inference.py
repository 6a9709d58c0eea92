"""The inference service the agent loop talks to; the engines behind it are in ``unipg.sample.engines``.

``InferenceEngine`` is the ``hf`` engine's service (dynamic batching of ``LMPolicy.sample``); ``TurnOutput`` and
``SamplingParams`` are shared by every engine.
"""

from unipg.sample.engines import ENGINES
from unipg.sample.engines.base import SamplingParams, TurnOutput
from unipg.sample.engines.hf import InferenceEngine

__all__ = ["ENGINES", "InferenceEngine", "SamplingParams", "TurnOutput"]
