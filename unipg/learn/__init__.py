"""How the policy learns from a batch: the one objective J = E_μ[ρ·A·w(ρ, age)] for both modes (``objective``),
the gym learners incl. TRPO (``gym``), the lm learner and its batch layout (``lm``, ``lm_batch``), supervised
fine-tuning and the cached warm start (``sft``, ``warm_start``), optimizer and generator state (``state``)."""
