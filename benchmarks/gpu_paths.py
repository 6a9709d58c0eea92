"""One GPU path of unipg, run once in this process on the embedded model: prints one line, ``PASS <path>
<figure>``, ``FAIL <path> <reason>`` or ``SKIP <path> <reason>``. ``benchmarks/gpu_check.py`` runs every path this
way, each in a process of its own under a timeout; this file holds the paths.

    python benchmarks/gpu_paths.py hf-generate --device cuda
    python benchmarks/gpu_paths.py learner-2proc --device cpu    # the same code on the CPU (gloo)
    python benchmarks/gpu_paths.py --smoke                        # hf-generate on the CPU, seconds

Each path is a function of the device (``cuda``, ``cpu``) and the model name that returns its figure, or raises
``PathFailed`` with a one-line reason. Nothing is downloaded: the model is built locally
(``unipg.policy.embedded``), and the packages a path needs beyond torch, transformers and peft are optional
(``GpuPath.needs``: absent means SKIP).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from engines import prompt_ids, single_turn  # noqa: E402
from learner import GROUP, skewed_batch  # noqa: E402

from unipg.config import load_config  # noqa: E402
from unipg.inference import ENGINES, SamplingParams  # noqa: E402
from unipg.learn.lm import LMBatch  # noqa: E402
from unipg.learn.sharded import ShardedLMLearner  # noqa: E402
from unipg.policy.adapters import synced_state  # noqa: E402
from unipg.policy.loading import policy_from_config  # noqa: E402
from unipg.runtime.backends import LEARNER_RANKS, make_learner  # noqa: E402
from unipg.runtime.backends.local_lm import inference_copy  # noqa: E402
from unipg.runtime.driver import WeightSync  # noqa: E402

MAIN_JOB = ROOT / "configs" / "calculator_agent.yaml"
# the main job for 2 updates: no warm start (minutes of SFT), evaluation before and after only, quiet logs
TRAIN_OVERRIDES = (
    "model.warm_start=false train.updates=2 sample.dynamic_sampling=false eval.every_updates=100 eval.max_examples=8 "
    "eval.pass_k=0 checkpoint.every_updates=0 log.run_name=gpu-check log.progress=false log.tensorboard=false"
).split()
GIB = 2**30
MAX_LOGPROB_GAP = 0.1  # mean |Δ log-prob| between an engine and the trainer on the same weights (bf16 kernels differ)


class PathFailed(Exception):
    """A path ran and found something wrong; the message is the FAIL line's reason."""


@dataclass(frozen=True)
class Sizes:
    """How much work one path does: the same code on a GPU and, smaller, on a CPU."""

    prompts: int  # single-turn generation requests
    new_tokens: int  # tokens sampled per request
    trajectories: int  # rows of a learner batch
    longest: int  # longest completion of a learner batch, in tokens (the embedded model's context is 512)
    train_batch: int  # train.batch_size of the 2-update run


GPU_SIZES = Sizes(prompts=256, new_tokens=128, trajectories=64, longest=400, train_batch=128)
CPU_SIZES = Sizes(prompts=8, new_tokens=16, trajectories=8, longest=40, train_batch=16)


def sizes(device: str) -> Sizes:
    return CPU_SIZES if device == "cpu" else GPU_SIZES


def on_gpu(device: str) -> bool:
    return device != "cpu"


def run_config(device: str, model: str, *overrides: str):
    """A GRPO config on ``model`` and ``device`` with one epoch of one mini-batch of ``sizes(device).trajectories``."""
    count = sizes(device).trajectories
    return load_config(
        None,
        [
            "task.name=arithmetic",
            "algorithm=grpo",
            f"model.name={model}",
            f"device={device}",
            f"sample.samples_per_prompt={GROUP}",
            "sample.max_new_tokens=128",
            f"train.batch_size={count}",
            f"train.mini_batch_size={count}",
            f"train.micro_batch_size={max(count // 4, 1)}",
            "train.num_epochs=1",
            "estimator.kl_coef=0.0",
            "log.progress=false",
            *overrides,
        ],
    )


def learner_batch(device: str, seed: int = 0) -> LMBatch:
    """A length-skewed batch (``benchmarks/learner.py``) whose rows score 0 or 1, so that GRPO's advantages move
    the weights."""
    size = sizes(device)
    batch = skewed_batch(size.trajectories, size.longest, seed)
    batch.scores = torch.randint(0, 2, (size.trajectories,), generator=torch.Generator().manual_seed(seed)).float()
    return batch


def timed_update(learner, batch: LMBatch, device: str) -> tuple[dict[str, float], float]:
    """The learner's metrics of prepare + update on ``batch``, and its seconds (the GPU's work included)."""
    start = time.perf_counter()
    learner.prepare(batch)
    metrics = learner.update(batch)
    if on_gpu(device):
        torch.cuda.synchronize()
    return metrics, time.perf_counter() - start


def peak_memory(device: str) -> str:
    if not on_gpu(device):
        return "peak GPU memory n/a on cpu"
    return f"peak GPU memory {torch.cuda.max_memory_allocated() / GIB:.2f} GiB"


def check(condition: bool, reason: str) -> None:
    if not condition:
        raise PathFailed(reason)


def finite(metrics: dict[str, float]) -> bool:
    return all(math.isfinite(metrics[key]) for key in ("loss", "grad_norm"))


def trained(policy) -> dict[str, torch.Tensor]:
    """Copies of the policy's trainable parameters (the critic's included)."""
    return {name: p.detach().clone() for name, p in policy.named_parameters() if p.requires_grad}


def largest_change(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    return max(float((after[name].float() - tensor.float()).abs().max()) for name, tensor in before.items())


@torch.no_grad()
def logprob_gap(policy, contexts: list[list[int]], outputs) -> float:
    """Mean |engine log-prob − trainer log-prob| of the sampled tokens, the trainer's from ``policy.model`` now."""
    gaps = []
    for context, out in zip(contexts, outputs):
        ids = torch.tensor([context + out.token_ids], device=policy.device)
        logits = policy.model(ids).logits[0, len(context) - 1 : -1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(context) :, None]).squeeze(-1).cpu()
        gaps.append((expected - torch.tensor(out.behaviour_logprobs)).abs())
    return float(torch.cat(gaps).mean())


def generate(service, contexts: list[list[int]], new_tokens: int) -> list:
    async def run():
        async with service.running():
            return await asyncio.gather(*(service.generate(c, max_new_tokens=new_tokens) for c in contexts))

    return asyncio.run(run())


# ---------------------------------------------------------------------------------------------------------------
# The paths


def hf_generate(device: str, model: str) -> str:
    """The hf engine samples a batch of single-turn requests with its KV cache."""
    size = sizes(device)
    config = run_config(device, model, f"model.dtype={'bfloat16' if on_gpu(device) else 'float32'}")
    policy = policy_from_config(config)
    policy.eos_ids = []  # every request samples exactly new_tokens tokens
    engine = ENGINES.get("hf")(policy, config)

    def service():
        return engine.service(SamplingParams(), torch.Generator().manual_seed(0), batch_wait=0.005, max_batch=1024)

    prompts = prompt_ids(policy, size.prompts)
    single_turn(service(), prompts[:8], 8)  # warm-up: kernels and allocator
    rate = single_turn(service(), prompts, size.new_tokens)
    return f"{rate:,.0f} tokens/s ({size.prompts} requests x {size.new_tokens} tokens, {config.model.dtype})"


def vllm_sleep_sync(device: str, model: str) -> str:
    """vLLM in process: generate, sleep, the learner fills the freed memory, wake, and load a new weights version."""
    size, gpu = sizes(device), on_gpu(device)
    config = run_config(
        device,
        model,
        "sample.engine=vllm",
        f"model.dtype={'bfloat16' if gpu else 'float32'}",
        f"sample.engine_sleep={str(gpu).lower()}",
        "sample.cpu_kv_cache_gb=0.25",
    )
    policy = policy_from_config(config)
    policy.eos_ids = []
    start = time.perf_counter()
    engine = ENGINES.get("vllm")(policy, config)
    started = time.perf_counter() - start
    try:
        # a Ray rollout worker on a GPU hands the engine a generator on the policy's device
        generator = torch.Generator(policy.device).manual_seed(0)
        prompts = prompt_ids(policy, size.prompts)
        single_turn(engine.service(SamplingParams(), generator), prompts[:8], 8)  # warm-up, then a sleep and a wake
        rate = single_turn(engine.service(SamplingParams(), generator), prompts, size.new_tokens)
        asleep = fill_freed_memory() if gpu else "sleep: CUDA only"
        with torch.no_grad():  # a new version: every MLP weight moved
            for name, parameter in policy.model.named_parameters():
                if "mlp" in name:
                    parameter.mul_(1.5)
        service = engine.service(SamplingParams(), generator)
        service.policy_version = 1  # running() wakes the engine, then loads version 1
        contexts = prompts[:16]
        outputs = wake_and_generate(service, contexts)
        sync = engine.metrics()["engine/weight_sync_seconds"]
    finally:
        engine.close()
    check({out.policy_version for out in outputs} == {1}, "turns after the sync are not stamped version 1")
    gap = logprob_gap(policy, contexts, outputs)
    check(gap < MAX_LOGPROB_GAP, f"engine log-probs are {gap:.3f} from the new weights' (the reload did not take)")
    return (
        f"start {started:.1f} s, {rate:,.0f} tokens/s ({size.prompts} x {size.new_tokens}); {asleep}; "
        f"weight sync of version 1 {sync:.2f} s, mean |Δ log-prob| vs trainer {gap:.4f}"
    )


def wake_and_generate(service, contexts: list[list[int]]) -> list:
    """Turns of ``service``, whose ``running()`` wakes the engine; running out of memory there is a FAIL that names
    the cached blocks."""
    try:
        return generate(service, contexts, 32)
    except Exception as error:  # noqa: BLE001 — torch's OutOfMemoryError, or vLLM's allocator's own error
        if "out of memory" not in str(error).lower():
            raise
        cached = torch.cuda.memory_reserved() / GIB
        raise PathFailed(
            f"out of memory waking vLLM while torch held {cached:.1f} GiB cached: the engine's wake-up does not "
            "release torch's cached blocks first (torch.cuda.empty_cache())"
        ) from None


def fill_freed_memory() -> str:
    """After the engine's sleep, allocate what is free but a margin, as a learner update that uses the memory sleep
    freed would, and free it again (torch keeps it cached): the next wake-up must still find room."""
    free = torch.cuda.mem_get_info()[0]
    margin = 4 * GIB
    if free > margin:
        block = torch.empty(free - margin, dtype=torch.uint8, device="cuda")
        del block
    return f"asleep with {free / GIB:.1f} GiB free, {max(free - margin, 0) / GIB:.1f} GiB then cached by torch"


def bf16_masters_update(device: str, model: str) -> str:
    """One learner update of bfloat16 weights through float32 masters (with a reference copy for the KL)."""
    config = run_config(device, model, "model.dtype=bfloat16", "estimator.kl_coef=0.04")
    policy = policy_from_config(config)
    learner = make_learner(policy, config)
    pairs = [(weight, master) for weight, master in learner.masters.pairs if weight.dim() == 2]
    check(bool(pairs) and all(m.dtype == torch.float32 for _, m in pairs), "no float32 masters of the bf16 weights")
    weight, master = pairs[-1]
    before = weight.detach().clone()
    batch = learner_batch(device)
    if on_gpu(device):
        torch.cuda.reset_peak_memory_stats()
    metrics, seconds = timed_update(learner, batch, device)
    check(finite(metrics), f"loss {metrics['loss']} or grad_norm {metrics['grad_norm']} is not finite")
    check(not torch.equal(before, weight.detach()), "the update left the bfloat16 weights where they were")
    check(torch.equal(weight.detach(), master.detach().to(weight.dtype)), "a weight is not its master rounded")
    tokens = int(batch.attention_mask.sum())
    return (
        f"{len(learner.masters.pairs)} float32 masters; prepare+update {seconds:.2f} s "
        f"({tokens / seconds:,.0f} tokens/s), {peak_memory(device)}"
    )


def attention_for(device: str) -> str:
    """flash_attention_2 on a GPU where flash_attn is importable, else sdpa."""
    flash = on_gpu(device) and importlib.util.find_spec("flash_attn") is not None
    return "flash_attention_2" if flash else "sdpa"


def packed_update(device: str, model: str) -> str:
    """A learner update on packed micro-batches; packed log-probs equal padded ones (no attention across rows)."""
    batch = learner_batch(device)
    budget = int(batch.attention_mask.sum()) // 2 + 1  # two or three packed rows
    dtype = "bfloat16" if on_gpu(device) else "float32"
    config = run_config(device, model, f"model.dtype={dtype}", f"train.max_tokens_per_micro_batch={budget}")
    policy = policy_from_config(config)
    implementation = attention_for(device)
    policy.model.set_attn_implementation(implementation)
    learner = make_learner(policy, config)  # sets policy.packed
    rows = batch.rows(torch.arange(min(8, len(batch.scores)))).move_to(policy.device)
    with torch.no_grad():
        packed = policy.evaluate(rows.input_ids, rows.attention_mask, rows.completion_length).logprobs
        policy.packed = False
        padded = policy.evaluate(rows.input_ids, rows.attention_mask, rows.completion_length).logprobs
        policy.packed = True
    gap = float((packed.float() - padded.float()).abs()[rows.completion_mask.bool()].mean())
    check(gap < MAX_LOGPROB_GAP, f"packed log-probs are {gap:.3f} from padded ones ({implementation}): rows leak")
    if on_gpu(device):
        torch.cuda.reset_peak_memory_stats()
    metrics, seconds = timed_update(learner, batch, device)
    check(finite(metrics), f"loss {metrics['loss']} or grad_norm {metrics['grad_norm']} is not finite")
    used = policy.model.config._attn_implementation  # sdpa may give way to unipg's own packed attention
    check(implementation == "sdpa" or used == implementation, f"asked for {implementation}, the model runs {used}")
    why = "" if implementation != "sdpa" or not on_gpu(device) else " (flash_attn not importable)"
    return (
        f"attention {used}{why}, {dtype}; {int(batch.attention_mask.sum()) / seconds:,.0f} tokens/s in "
        f"{budget}-token micro-batches; packed vs padded mean |Δ log-prob| {gap:.4f}; {peak_memory(device)}"
    )


def lora_adapter_sync(device: str, model: str) -> str:
    """A LoRA update (PEFT), then the adapter alone synced to the engine: vLLM where importable (a LoRARequest per
    version), else the hf engine's sampling copy (``WeightSync``, as the concurrent schedule keeps one)."""
    engine_name = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    dtype = "bfloat16" if on_gpu(device) else "float32"
    overrides = ("model.lora_rank=8", f"model.dtype={dtype}", "train.learning_rate=1e-2", "sample.cpu_kv_cache_gb=0.25")
    config = run_config(device, model, *overrides, f"sample.engine={engine_name}")
    policy = policy_from_config(config)
    base = {name: p.detach().clone() for name, p in policy.model.named_parameters() if not p.requires_grad}
    engine = ENGINES.get("vllm")(policy, config) if engine_name == "vllm" else None
    copy = inference_copy(policy) if engine is None else None  # taken before the update, as the adapter starts
    try:
        learner = make_learner(policy, config)
        metrics, seconds = timed_update(learner, learner_batch(device), device)
        check(finite(metrics), f"loss {metrics['loss']} or grad_norm {metrics['grad_norm']} is not finite")
        check(largest_change(base, dict(policy.model.named_parameters())) == 0, "the LoRA update moved base weights")
        sent = synced_state(policy.model)
        check(bool(sent) and all("lora_" in name for name in sent), "the sync sends more than the adapter")
        synced = vllm_adapter_sync(engine, policy) if engine is not None else hf_adapter_sync(copy, policy)
    finally:
        if engine is not None:
            engine.close()
    adapter_mib = sum(t.numel() * t.element_size() for t in sent.values()) / 2**20
    return f"update {seconds:.2f} s; {len(sent)} adapter tensors ({adapter_mib:.2f} MiB) to {engine_name}: {synced}"


@torch.no_grad()
def largest_logit_gap(first, second, ids: torch.Tensor) -> float:
    return float((first.model(ids).logits - second.model(ids).logits).abs().max())


def hf_adapter_sync(copy, policy) -> str:
    """The sampling copy takes the updated adapter by version and then computes what the learner computes."""
    ids = torch.tensor([prompt_ids(policy, 1)[0]], device=policy.device)
    stale = largest_logit_gap(copy, policy, ids)
    check(stale > 0, "the update left the adapter where it was")
    sync = WeightSync(policy.model, copy.model)
    sync.publish(1)
    check(sync.pull() == 1, "the sampling copy did not take version 1")
    gap = largest_logit_gap(copy, policy, ids)
    check(gap == 0, f"the sampling copy's logits are {gap:.2e} from the learner's after the sync")
    return f"sampling copy equal to the learner after {sync.pop_seconds():.3f} s (|Δ logit| before {stale:.2e})"


def vllm_adapter_sync(engine, policy) -> str:
    """vLLM samples version 1 with the updated adapter, not the base weights."""
    service = engine.service(SamplingParams(), torch.Generator(policy.device).manual_seed(0))
    service.policy_version = 1
    contexts = prompt_ids(policy, 8)
    outputs = generate(service, contexts, 32)
    seconds = engine.metrics()["engine/weight_sync_seconds"]
    check({out.policy_version for out in outputs} == {1}, "turns after the sync are not stamped version 1")
    gap = logprob_gap(policy, contexts, outputs)
    with policy.model.disable_adapter():
        base_gap = logprob_gap(policy, contexts, outputs)
    check(
        gap < MAX_LOGPROB_GAP and gap < base_gap, f"vLLM samples the base ({base_gap:.3f}), not the adapter ({gap:.3f})"
    )
    return f"new adapter in {seconds:.2f} s; mean |Δ log-prob| vs trainer {gap:.4f} (vs base weights {base_gap:.4f})"


def sharded_config(device: str, model: str, *overrides: str):
    """PPO with a separate critic in bfloat16: the sharded paths' float32 value head beside bf16 weights."""
    return run_config(
        device,
        model,
        "algorithm=ppo",
        f"model.critic={model}",
        "model.dtype=bfloat16",
        "estimator.kl_coef=0.04",
        *overrides,
    )


def sharded_round_trip(learner, policy, device: str) -> str:
    """prepare + update; the ranks write their shards; another update; the shards load back; an update at learning
    rate 0 must leave the weights the checkpoint's (the float32 masters restored with them)."""
    metrics, seconds = timed_update(learner, learner_batch(device), device)
    check(finite(metrics), f"loss {metrics['loss']} or grad_norm {metrics['grad_norm']} is not finite")
    with tempfile.TemporaryDirectory(prefix="unipg-gpu-shards-") as shards:
        state = learner.state()
        learner.save_shards(Path(shards))
        saved = trained(policy)
        timed_update(learner, learner_batch(device, seed=1), device)
        learner.load_shards(Path(shards), state)  # the driver's policy gets the restored weights
    learner.set_lr_fraction(0.0)
    timed_update(learner, learner_batch(device, seed=2), device)
    moved = largest_change(saved, trained(policy))
    check(moved == 0, f"an lr-0 update after a restore moved the weights by {moved:.2e} (stale float32 masters)")
    return f"prepare+update {seconds:.2f} s; checkpoint, restore and an lr-0 update keep the weights"


def learner_2proc(device: str, model: str) -> str:
    """train.learner_processes=2 in local processes (device=auto on a GPU: a GPU per rank, NCCL and gloo)."""
    config = sharded_config("auto" if on_gpu(device) else device, model, "train.learner_processes=2")
    policy = policy_from_config(config)
    learner = make_learner(policy, config)
    try:
        figure = sharded_round_trip(learner, policy, device)
    finally:
        learner.close()
    group = "cpu:gloo,cuda:nccl" if on_gpu(device) else "gloo"
    return f"2 ranks, group {group}, bf16 + separate critic; {figure}"


def ray_gpu_bundle(device: str, model: str) -> str:
    """One learner rank as a Ray actor in a placement-group bundle with a GPU."""
    from unipg.runtime.backends.ray_setup import learner_bundles

    config = sharded_config(
        device, model, "backend=ray", "ray.rollout_workers=1", "ray.rollout_num_cpus=0.5", "ray.learner_num_cpus=0.5"
    )
    bundle = learner_bundles(config, 1)[0]
    check(not on_gpu(device) or bundle.get("GPU") == 1, f"the rank's bundle {bundle} holds no GPU")
    policy = policy_from_config(config)
    start = time.perf_counter()
    learner = ShardedLMLearner(policy, config, 1, LEARNER_RANKS.get("ray")())
    started = time.perf_counter() - start
    try:
        figure = sharded_round_trip(learner, policy, device)
    finally:
        learner.close()
    return f"bundle {bundle}, actor up in {started:.1f} s; {figure}"


def train_2_updates(device: str, model: str) -> str:
    """``unipg train`` on the README's main-job config for 2 updates (no warm start, no evaluation in between)."""
    size = sizes(device)
    with tempfile.TemporaryDirectory(prefix="unipg-gpu-check-") as runs:
        overrides = [
            f"device={device}",
            *(["model.dtype=bfloat16"] if on_gpu(device) else []),
            *(["model.name=" + model] if model != "embedded" else []),
            *(f"train.{key}={size.train_batch}" for key in ("batch_size", "mini_batch_size")),
            f"train.micro_batch_size={min(size.train_batch, 64)}",
            f"log.output_dir={runs}",
            *TRAIN_OVERRIDES,
        ]
        start = time.perf_counter()
        command = [sys.executable, "-m", "unipg.cli", "train", "--config", str(MAIN_JOB), *overrides]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - start
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-8000:])
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        check(done.returncode == 0, f"unipg train exited {done.returncode}: {last[:200]}")
        run = Path(runs) / "gpu-check"
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        updates = [r for r in records if "timing/samples_per_second" in r]
        checkpoints = sorted(path.name for path in (run / "checkpoints").glob("step-*"))
    check(len(updates) == 2, f"metrics.jsonl holds {len(updates)} updates, not 2")
    check(bool(checkpoints), "the run saved no final checkpoint")
    second = updates[-1]
    return (
        f"2 updates of {size.train_batch} samples in {seconds:.0f} s (start-up included); update 2: "
        f"{second['timing/samples_per_second']:.1f} samples/s, {second['timing/tokens_per_second']:,.0f} tokens/s; "
        f"checkpoint {checkpoints[-1]}"
    )


@dataclass(frozen=True)
class GpuPath:
    """One path: its function, the seconds ``gpu_check.py`` gives its process, what it needs to run."""

    run: Callable[[str, str], str]
    timeout: int
    needs: tuple[str, ...] = ()  # importable packages
    gpus: int = 1  # CUDA devices it needs (on a GPU)


PATHS = {
    "hf-generate": GpuPath(hf_generate, 90),
    "vllm-sleep-sync": GpuPath(vllm_sleep_sync, 240, needs=("vllm",)),
    "bf16-masters-update": GpuPath(bf16_masters_update, 90),
    "packed-attention-update": GpuPath(packed_update, 90),
    "lora-adapter-sync": GpuPath(lora_adapter_sync, 180, needs=("peft",)),
    "learner-2proc": GpuPath(learner_2proc, 150, gpus=2),
    "ray-gpu-bundle": GpuPath(ray_gpu_bundle, 150, needs=("ray",)),
    "train-2-updates": GpuPath(train_2_updates, 180),
}


def skip_reason(name: str, device: str) -> str | None:
    """Why path ``name`` cannot run on ``device`` on this machine (a SKIP line's reason); None if it can."""
    path = PATHS[name]
    if on_gpu(device):
        if not torch.cuda.is_available():
            return "no CUDA device"
        if torch.cuda.device_count() < path.gpus:
            return f"{torch.cuda.device_count()} CUDA device(s), it needs {path.gpus}"
    missing = [package for package in path.needs if importlib.util.find_spec(package) is None]
    if missing:
        return f"{missing[0]} is not importable (install its wheel to run this path)"
    return None


def run_path(name: str, device: str, model: str) -> str:
    """The path's line: PASS with its figure, SKIP with why, or FAIL with a one-line reason."""
    reason = skip_reason(name, device)
    if reason is not None:
        return f"SKIP {name} {reason}"
    try:
        return f"PASS {name} {PATHS[name].run(device, model)}"
    except PathFailed as failure:
        return f"FAIL {name} {failure}"
    except Exception as error:  # noqa: BLE001 — any error of the path is its FAIL line
        first = (str(error).strip().splitlines() or [""])[0][:240]
        return f"FAIL {name} {type(error).__name__}: {first}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", nargs="?", choices=sorted(PATHS))
    parser.add_argument("--device", default="cuda", help="cuda or cpu (gpu_check.py maps cuda:N to cuda)")
    parser.add_argument("--model", default="embedded", help="a model name or folder, loaded without network")
    parser.add_argument("--smoke", action="store_true", help="hf-generate on the CPU: a check that the file runs")
    args = parser.parse_args()
    if args.smoke:
        args.path, args.device = "hf-generate", "cpu"
    if args.path is None:
        parser.error("name a path, one of: " + ", ".join(PATHS))
    torch.manual_seed(0)
    print(run_path(args.path, args.device, args.model), flush=True)


if __name__ == "__main__":
    main()
