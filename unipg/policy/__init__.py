"""Q1, how the policy is parameterised: a Hugging Face causal LM with value head, critic, reference and LoRA
(``lm``; its forward passes and generation in ``forward`` and ``generation``), loading and chat templates, the
embedded model, and the MLP actor-critic of gym runs."""
