"""The vLLM service's request seeds are drawn on the device of the generator it was handed."""

import torch

from unipg.inference.vllm import request_seed


def test_a_request_seed_is_drawn_on_the_generators_device_not_the_default_one():
    # On a GPU rollout worker the generator is a CUDA one and the default device the CPU; here the default device
    # is "meta" and the generator a CPU one: a draw on the default device gives no value to read.
    generator = torch.Generator().manual_seed(0)
    expected = request_seed(torch.Generator().manual_seed(0))
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        seed = request_seed(generator)
    finally:
        torch.set_default_device(previous)
    assert seed == expected and 0 <= seed < 2**31 - 1
