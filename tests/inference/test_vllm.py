"""The vLLM service: request seeds drawn on the device of the generator it was handed; what vLLM reports per step."""

import asyncio

import pytest
import torch

from unipg.inference.vllm import WeightPull, request_seed


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


def test_a_weight_load_goes_on_when_the_request_that_started_it_is_cancelled():
    """``sync`` hands a version once: a request cancelled while that version loads (an interrupted group) must not
    cancel the load, and a request arriving meanwhile waits for it instead of pulling again."""
    handed, loaded = [3], []

    def sync():
        return handed.pop() if handed else None

    async def scenario():
        loading, release = asyncio.Event(), asyncio.Event()

        async def load(version):
            loading.set()
            await release.wait()
            loaded.append(version)

        pull = WeightPull(sync, load)
        first = asyncio.ensure_future(pull())
        await loading.wait()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        second = asyncio.ensure_future(pull())
        release.set()
        await second
        await pull()  # nothing newer: no load

    asyncio.run(scenario())
    assert loaded == [3]


def test_turn_versions_say_which_version_sampled_which_tokens_of_an_interrupted_turn():
    from unipg.inference.vllm_core import turn_versions

    assert turn_versions((), 3, 5) == (3, ())  # never interrupted
    assert turn_versions([(4, 2)], 3, 10) == (2, ((4, 3),))  # 4 tokens by version 2, the rest by 3
    assert turn_versions([(0, 2)], 3, 10) == (3, ())  # interrupted before its first token
    assert turn_versions([(4, 2), (4, 3)], 5, 10) == (2, ((4, 5),))  # nothing sampled between two loads
    assert turn_versions([(4, 2), (7, 3)], 4, 7) == (2, ((4, 3),))  # the last load came after its last token
    assert turn_versions([(4, 2)], 2, 9) == (2, ())  # a load of the same version changes nothing


def test_only_requests_a_weight_load_may_interrupt_report_their_tokens_after_every_step():
    # An interrupted request continues from the tokens it had, which vLLM reports only for cumulative outputs;
    # any other request is reported once it finishes, so no output is copied per step for it.
    pytest.importorskip("vllm")
    from vllm.sampling_params import RequestOutputKind

    from unipg.inference.base import SamplingParams
    from unipg.inference.vllm_setup import vllm_sampling

    def kind(interruptible: bool):
        return vllm_sampling(
            SamplingParams(temperature=1.0), max_tokens=8, seed=0, eos_ids=[1], interruptible=interruptible
        ).output_kind

    assert kind(True) == RequestOutputKind.CUMULATIVE
    assert kind(False) == RequestOutputKind.FINAL_ONLY


def test_vllms_cpu_norm_kernels_give_the_native_norms_results_and_leave_it_the_arguments_they_do_not_take():
    pytest.importorskip("vllm")
    if torch.cuda.is_available():
        pytest.skip("the CPU kernels are registered on a CPU only")
    from unipg.inference.vllm_setup import CPU_KERNELS, cpu_kernel_priority, import_vllm

    import_vllm()
    from vllm import ir

    assert cpu_kernel_priority() == {"rms_norm": [CPU_KERNELS], "fused_add_rms_norm": [CPU_KERNELS]}
    generator = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(shape, generator=generator) for shape in ((5, 128), (5, 128), (128,)))
    norm, native_norm = (ir.ops.rms_norm.impls[p] for p in (CPU_KERNELS, "native"))
    torch.testing.assert_close(norm.impl_fn(x, weight, 1e-6), native_norm.impl_fn(x, weight, 1e-6))
    fused, native_fused = (ir.ops.fused_add_rms_norm.impls[p] for p in (CPU_KERNELS, "native"))
    expected = native_fused.impl_fn(x.clone(), residual.clone(), weight, 1e-6)
    torch.testing.assert_close(fused.impl_fn(x.clone(), residual.clone(), weight, 1e-6), expected)
    assert not norm.supports_args(x, weight, 1e-6, variance_size=64)  # a variance over part of the channels
    assert not fused.supports_args(x.t(), residual.t(), weight, 1e-6)  # strided input


def test_vllm_runs_eagerly_on_cpu_unless_the_config_asks_for_the_compiled_model(tmp_path):
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from unipg.config import load_config
    from unipg.inference.vllm_setup import engine_args

    policy = SimpleNamespace(context_length=64)

    def eager(*overrides):
        sample = load_config(overrides=list(overrides)).sample
        return engine_args(tmp_path, policy, sample, dtype="float32", seed=0, lora_rank=0).enforce_eager

    assert eager() is True  # unset: eager on CPU (a GPU compiles and captures CUDA graphs)
    assert eager("sample.vllm_enforce_eager=false") is False
    assert eager("sample.vllm_enforce_eager=true") is True
