"""What importing unipg does to the environment."""

import importlib.util
import sys

import unipg


def test_torch_companions_built_for_another_torch_are_hidden_and_transformers_still_imports():
    for name in unipg.HIDDEN_PACKAGES:
        assert sys.modules[name] is None and importlib.util.find_spec(name) is None
    from transformers import Qwen2ForCausalLM  # imports image utilities, which import torchvision if it is there

    assert Qwen2ForCausalLM.__name__ == "Qwen2ForCausalLM"
