"""unipg: policy-gradient reinforcement learning, from CartPole to tool-using language-model agents.

    import unipg
    result = unipg.train("configs/cartpole_ppo.yaml", train__updates=2)
    print(result.run_dir, result.metrics)

``train`` runs a configuration (a YAML path or a ``Config``) with keyword overrides; ``evaluate`` gives the
held-out metrics of a finished language-model run; ``load_config`` validates a configuration without running it.
"""

from unipg.api import RunResult, evaluate, load_config, train
from unipg.config import Config, ConfigError

__all__ = ["Config", "ConfigError", "RunResult", "evaluate", "load_config", "train"]
__version__ = "0.1.0"
