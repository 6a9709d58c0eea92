"""The ``device`` setting: one reading for both modes; a device asked for and absent is refused at load time."""

import pytest
import torch

from unipg.config import ConfigError, load_config
from unipg.config.devices import resolve_device, torch_dtype

TEXT = ["task.name=arithmetic", "algorithm=grpo"]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


@NO_CUDA
def test_auto_is_the_cpu_on_a_machine_without_cuda():
    assert resolve_device("auto") == torch.device("cpu")
    assert load_config(None, [*TEXT, "device=auto"]).device == "auto"  # kept as written; resolved where used


@NO_CUDA
@pytest.mark.parametrize("mode", [TEXT, []], ids=["lm", "gym"])
def test_cuda_asked_for_and_absent_is_a_config_error_in_both_modes(mode):
    with pytest.raises(ConfigError, match=r"device 'cuda': CUDA is not available on this machine .* set device=cpu"):
        load_config(None, [*mode, "device=cuda"])
    with pytest.raises(ConfigError, match="CUDA is not available"):
        resolve_device("cuda:0")


def test_a_gpu_index_the_machine_lacks_is_a_config_error():
    with pytest.raises(ConfigError, match=r"device 'cuda:99': (CUDA is not available|this machine has \d+ CUDA)"):
        load_config(None, [*TEXT, "device=cuda:99"])


@pytest.mark.parametrize("name", ["tpu9", "gpu", "cuda:x", "CPU"])
def test_a_name_that_is_not_a_device_lists_the_valid_ones(name):
    with pytest.raises(ConfigError, match=rf"device '{name}' is not a device name; use cpu, cuda, cuda:N .*auto"):
        load_config(None, [*TEXT, f"device={name}"])


def test_dtype_is_the_models_and_may_be_set_beside_device():
    config = load_config(None, [*TEXT, "device=cpu", "dtype=bfloat16"])
    assert config.model.dtype == "bfloat16" and torch_dtype(config.model.dtype) is torch.bfloat16
    with pytest.raises(ConfigError, match="'model.dtype'"):
        load_config(None, [*TEXT, "model.dtype=float64"])
    with pytest.raises(ConfigError, match="dtype 'int8' is not one of: float32, bfloat16, float16"):
        torch_dtype("int8")


def fake_gpus(monkeypatch, count: int) -> None:
    """A machine with ``count`` CUDA devices, as far as the config rules and the learner ranks can tell."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("backend", ["inprocess", "ray"])
def test_more_cuda_learner_ranks_than_gpus_is_a_config_error(monkeypatch, backend):
    fake_gpus(monkeypatch, 1)
    with pytest.raises(
        ConfigError,
        match=r"train.learner_processes \(2\) ranks on device 'cuda' take a GPU each; "
        r"this machine has 1: lower train.learner_processes",
    ):
        load_config(None, [*TEXT, "device=cuda", "train.learner_processes=2", f"backend={backend}"])
    fake_gpus(monkeypatch, 2)
    assert load_config(None, [*TEXT, "device=cuda", "train.learner_processes=2"]).train.learner_processes == 2


def test_each_local_learner_rank_takes_its_own_gpu(monkeypatch):
    from unipg.learn.sharded import rank_device

    fake_gpus(monkeypatch, 2)
    assert [rank_device("cuda", rank) for rank in (0, 1)] == ["cuda:0", "cuda:1"]
    fake_gpus(monkeypatch, 1)  # a Ray actor sees only the GPU it was given
    assert rank_device("cuda", 3) == "cuda:0"
    assert rank_device("cpu", 1) == "cpu"


def test_auto_learner_ranks_take_a_gpu_each_where_there_is_cuda_and_the_cpu_elsewhere(monkeypatch):
    from unipg.learn.distributed import group_backend
    from unipg.learn.sharded import rank_device

    fake_gpus(monkeypatch, 2)
    devices = [rank_device("auto", rank) for rank in (0, 1)]
    assert devices == ["cuda:0", "cuda:1"] and group_backend(devices[1]) == "cpu:gloo,cuda:nccl"
    fake_gpus(monkeypatch, 1)
    with pytest.raises(ConfigError, match=r"ranks on device 'auto' take a GPU each; this machine has 1"):
        load_config(None, [*TEXT, "device=auto", "train.learner_processes=2"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert rank_device("auto", 1) == "cpu" and group_backend(rank_device("auto", 1)) == "gloo"
    assert load_config(None, [*TEXT, "device=auto", "train.learner_processes=2"]).device == "auto"
