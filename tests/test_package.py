"""What importing unipg does to the environment."""

import importlib.util
import sys

import unipg
from unipg import companions_to_hide


def test_torch_companions_built_for_another_torch_are_hidden_and_transformers_still_imports():
    for name in unipg.HIDDEN_PACKAGES:
        assert sys.modules[name] is None and importlib.util.find_spec(name) is None
    from transformers import Qwen2ForCausalLM  # imports image utilities, which import torchvision if it is there

    assert Qwen2ForCausalLM.__name__ == "Qwen2ForCausalLM"


def test_companions_built_for_another_torch_are_told_apart_from_matching_ones():
    pypi = {
        "torchvision": ("0.28.0", ["torch (==2.13.0)", "numpy"]),
        "torchaudio": ("2.11.1", ["torch>=2.11"]),
        "torchcodec": ("0.17.0", []),
    }
    assert companions_to_hide("2.13.0+cpu", pypi) == ["torchvision", "torchaudio", "torchcodec"]
    assert companions_to_hide("2.13.0", {"torchvision": pypi["torchvision"]}) == []  # PyPI's torch and torchvision
    matching = {"torchvision": ("0.28.0+cpu", ["torch==2.13.0"]), "torchaudio": ("2.13.0+cpu", ["torch==2.13.0"])}
    assert companions_to_hide("2.13.0+cpu", matching) == []
    assert companions_to_hide("2.13.0+cpu", {}) == []
