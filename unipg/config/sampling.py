"""The one check of sampling parameters, shared by the run's configuration (the ``sample`` section), the engines'
``SamplingParams`` and the endpoint's requests: a value the sampler cannot use is refused, with what to use instead.

Temperature: 0 means greedy. A positive temperature below ``MIN_TEMPERATURE`` is refused rather than treated as
greedy, because the learner computes its log-probs from the same temperature (softmax(logits / temperature)):
logits are divided by it in float32, where 1e-300 is 0, so the division gives inf and NaN and sampling fails; just
above that, large logits overflow. vLLM raises every temperature below 0.01 to 0.01; refusing those keeps both
engines sampling the distribution that was asked for. For (near-)greedy decoding, use 0.
"""

from __future__ import annotations

import math

MIN_TEMPERATURE = 0.01
"""the smallest positive sampling temperature (0 = greedy)."""


def check_temperature(temperature: float) -> float:
    """``temperature`` if the sampler can use it: finite, and 0 (greedy) or at least ``MIN_TEMPERATURE``."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number ≥ 0, 0 meaning greedy (got {temperature!r})")
    if 0 < temperature < MIN_TEMPERATURE:
        raise ValueError(
            f"temperature {temperature:g} is too small to sample with (the logits divided by it overflow): the "
            f"smallest positive temperature is {MIN_TEMPERATURE:g}; use 0 for greedy decoding"
        )
    return temperature


def check_top_p(top_p: float | None) -> float | None:
    """``top_p`` if it is None or in (0, 1]."""
    if top_p is not None and not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], 1 keeping every token (got {top_p!r})")
    return top_p


def check_top_k(top_k: int | None) -> int | None:
    """``top_k`` if it is None (every token) or at least 1."""
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1, or unset to keep every token (got {top_k!r})")
    return top_k


def check_stop(stop: list[str] | None) -> list[str] | None:
    """``stop`` if none of its strings is empty: "" occurs at every position, so it would end every completion
    after its first token."""
    if stop is not None and any(text == "" for text in stop):
        raise ValueError(
            "stop strings must not be empty: an empty string matches everywhere and ends every completion after "
            "one token; remove it"
        )
    return stop


SAMPLING_CHECKS = {"temperature": check_temperature, "top_p": check_top_p, "top_k": check_top_k, "stop": check_stop}
"""parameter name → its check: a validator of every schema that takes sampling parameters applies these."""
