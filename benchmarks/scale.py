"""A real-size rehearsal on the CPU of the paths a GPU run takes, on a model of Qwen2.5-0.5B-Instruct's exact shape
built locally with random weights (``benchmarks/scale_model.py``; nothing is downloaded). One phase each:

- ``vllm-episode``: the ``vllm`` engine starts on the model and plays agent episodes of two turns each;
- ``vllm-weight-sync``: a new version of every weight into vLLM (``gpu_paths.vllm_sleep_sync``);
- ``learner-update``: prepare + update on packed micro-batches (``train.max_tokens_per_micro_batch=auto``) with
  gradient checkpointing and the logits computed in chunks (``model.logits_chunk_tokens``);
- ``lora-adapter-sync``: a LoRA update, then the adapter alone synced to vLLM (``gpu_paths.lora_adapter_sync``);
- ``fsdp2-2proc``: ``train.learner_processes=2`` over gloo, an update, a checkpoint and a restore
  (``gpu_paths.learner_2proc``);
- ``checkpoint-resume``: an update, the run's checkpoint written (``LMCheckpointer``), another update, and the
  checkpoint read back and restored over it.

Each phase runs in a process of its own, so the peak resident memory of a row is that phase's alone: the phase's
process (model load included) and, apart, the largest process it started and waited for (the FSDP ranks; a child
forked from the phase's process counts the pages it shares with it, so a fork's peak repeats its parent's). A row
gives the phase's seconds (start-up and load included), both peaks, the bytes a sync or checkpoint moved, and the
phase's own figures; a phase that fails prints FAIL and its reason in its row, and the script exits 1.

    python benchmarks/scale.py              # the 0.5B shape: ~2 GB per float32 copy, tens of minutes
    python benchmarks/scale.py --smoke      # 2 layers, a 4,096-token vocabulary: the same phases, small
    python benchmarks/scale.py --phases learner-update,checkpoint-resume
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from argparse import Namespace
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from engines import multi_turn  # noqa: E402
from gpu_paths import (  # noqa: E402
    check,
    finite,
    largest_change,
    learner_2proc,
    learner_batch,
    lora_adapter_sync,
    run_config,
    timed_update,
    vllm_sleep_sync,
)
from scale_model import QWEN_0_5B, SMOKE, scale_model_path  # noqa: E402

from unipg.checkpoint.files import load_checkpoint  # noqa: E402
from unipg.checkpoint.lm import LMCheckpointer  # noqa: E402
from unipg.config import load_config  # noqa: E402
from unipg.inference import ENGINES, SamplingParams  # noqa: E402
from unipg.policy.adapters import synced_state  # noqa: E402
from unipg.policy.loading import apply_lora, policy_from_config  # noqa: E402
from unipg.runtime.backends import make_learner  # noqa: E402
from unipg.runtime.prompts import PromptSampler  # noqa: E402
from unipg.tasks.base import Example  # noqa: E402

MIB = 2**20
RESULT_PREFIX = "RESULT "  # a phase process's last line: its measurements as JSON
LOGITS_CHUNK_TOKENS = 512
ERROR_LINE = re.compile(r"[\w.]*(Error|Exception): ")  # an exception's line with a message
ESCAPED_BAR = "\\|"  # a "|" inside a figure (|Δ log-prob|), which would otherwise end its table cell
# agent episodes of the vllm-episode phase: concurrent episodes of two turns, the tool answering in ~10 ms
EPISODES = Namespace(episodes=4, turns=2, turn_tokens=16, latency=0.01, sigma=0.5, seed=0)
KV_CACHE_GB = 0.25  # vLLM's CPU KV cache, as the reused GPU-path checks give it (~10k tokens of this shape)
SMOKE_TIMEOUT, FULL_TIMEOUT = 300, 3600  # seconds a phase's process may run


@dataclass(frozen=True)
class Measured:
    """What a phase reports beside its seconds and peaks: its own figures, and the bytes it moved (None: none)."""

    figure: str
    bytes_moved: int | None = None


@dataclass(frozen=True)
class Phase:
    run: Callable[[str], Measured]  # of the model folder
    needs: tuple[str, ...] = ()  # importable packages; absent means SKIP


def weights_bytes(model: str, lora_rank: int = 0) -> int:
    """Bytes of what a sync sends in float32 (``synced_state``; a tied table once): every weight, or with
    ``lora_rank`` the adapter's, counted on a model built on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = load_config(None, [f"model.name={model}"]).model
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model), dtype=torch.float32)
    if lora_rank:
        skeleton = apply_lora(
            skeleton, rank=lora_rank, alpha=config.lora_alpha, target_modules=config.lora_target_modules
        )
        return sum(tensor.numel() * 4 for tensor in synced_state(skeleton).values())
    return sum(parameter.numel() * 4 for parameter in skeleton.parameters())


def chunked_logits() -> tuple[list[str], str]:
    """The override that computes the logits in chunks, and how the row says it; none where this version of
    unipg has no ``model.logits_chunk_tokens``."""
    if "logits_chunk_tokens" not in type(load_config(None, []).model).model_fields:
        return [], "model.logits_chunk_tokens not in this version: whole logits"
    return [f"model.logits_chunk_tokens={LOGITS_CHUNK_TOKENS}"], f"logits in chunks of {LOGITS_CHUNK_TOKENS} tokens"


# ---------------------------------------------------------------------------------------------------------------
# The phases, each a function of the model folder


def vllm_episode(model: str) -> Measured:
    """The vllm engine's start-up, then concurrent agent episodes (``engines.multi_turn``) sampled by it."""
    config = run_config(
        "cpu", model, "sample.engine=vllm", "model.dtype=float32", f"sample.cpu_kv_cache_gb={KV_CACHE_GB}"
    )
    policy = policy_from_config(config)
    policy.eos_ids = []  # every turn samples exactly turn_tokens tokens
    start = time.perf_counter()
    engine = ENGINES.get("vllm")(policy, config)
    started = time.perf_counter() - start
    try:
        service = engine.service(SamplingParams(), torch.Generator().manual_seed(0))
        start = time.perf_counter()
        episodes_per_second, prefill = multi_turn(service, policy, EPISODES)
        seconds = time.perf_counter() - start
        turns = service.turns
    finally:
        engine.close()
    check(
        turns == EPISODES.episodes * EPISODES.turns, f"{turns} turns sampled, not {EPISODES.episodes * EPISODES.turns}"
    )
    return Measured(
        f"start {started:.1f} s; {EPISODES.episodes} episodes x {EPISODES.turns} turns x {EPISODES.turn_tokens} "
        f"tokens in {seconds:.1f} s ({episodes_per_second:.2f} episodes/s, {prefill:.0f} prefill tokens/turn)"
    )


def vllm_weight_sync(model: str) -> Measured:
    return Measured(vllm_sleep_sync("cpu", model), weights_bytes(model))


def learner_update(model: str) -> Measured:
    """prepare + update in float32, packed micro-batches, gradient checkpointing, chunked logits."""
    chunk, chunk_note = chunked_logits()
    config = run_config(
        "cpu",
        model,
        "model.dtype=float32",
        "train.max_tokens_per_micro_batch=auto",
        "model.gradient_checkpointing=true",
        *chunk,
    )
    policy = policy_from_config(config)
    learner = make_learner(policy, config)
    try:
        batch = learner_batch("cpu")
        metrics, seconds = timed_update(learner, batch, "cpu")
    finally:
        learner.close()
    check(finite(metrics), f"loss {metrics['loss']} or grad_norm {metrics['grad_norm']} is not finite")
    check(bool(policy.packed), "the learner did not pack its micro-batches")
    tokens = int(batch.attention_mask.sum())
    return Measured(
        f"prepare+update {seconds:.1f} s ({tokens / seconds:,.0f} tokens/s, {tokens} tokens), packed, "
        f"gradient checkpointing, {chunk_note}"
    )


def lora_sync(model: str) -> Measured:
    return Measured(lora_adapter_sync("cpu", model), weights_bytes(model, lora_rank=8))


def fsdp_update(model: str) -> Measured:
    return Measured(learner_2proc("cpu", model))


def checkpoint_resume(model: str) -> Measured:
    """An update, the run's checkpoint written, another update, the checkpoint loaded and restored: the weights
    are the saved ones again."""
    config = run_config("cpu", model, "model.dtype=float32")
    policy = policy_from_config(config)
    learner = make_learner(policy, config)
    sampler = PromptSampler([Example("question", "answer", "solution")], config.seed)
    try:
        timed_update(learner, learner_batch("cpu"), "cpu")
        with tempfile.TemporaryDirectory(prefix="unipg-scale-") as run_dir:
            checkpointer = LMCheckpointer(
                Path(run_dir), config.checkpoint, model, policy, learner, sampler, torch.Generator().manual_seed(0)
            )
            start = time.perf_counter()
            path = checkpointer.save(1, samples=0, train_seconds=0.0, history=[], metrics={})
            saved_seconds = time.perf_counter() - start
            written = sum(file.stat().st_size for file in path.rglob("*") if file.is_file())
            watched = dict(list(policy.named_parameters())[-3:])  # a few weights, copied: the whole is ~2 GB
            saved = {name: parameter.detach().clone() for name, parameter in watched.items()}
            timed_update(learner, learner_batch("cpu", seed=1), "cpu")
            start = time.perf_counter()
            checkpointer.restore(load_checkpoint(path))
            restored_seconds = time.perf_counter() - start
    finally:
        learner.close()
    moved = largest_change(saved, {name: parameter.detach() for name, parameter in policy.named_parameters()})
    check(moved == 0, f"the restored weights are {moved:.2e} from the saved ones")
    return Measured(
        f"save {saved_seconds:.1f} s, load + restore {restored_seconds:.1f} s of {written / MIB:,.0f} MiB "
        "(weights and AdamW state); restored weights equal the saved ones",
        written,
    )


PHASES = {
    "vllm-episode": Phase(vllm_episode, needs=("vllm",)),
    "vllm-weight-sync": Phase(vllm_weight_sync, needs=("vllm",)),
    "learner-update": Phase(learner_update),
    "lora-adapter-sync": Phase(lora_sync, needs=("peft", "vllm")),
    "fsdp2-2proc": Phase(fsdp_update),
    "checkpoint-resume": Phase(checkpoint_resume),
}


# ---------------------------------------------------------------------------------------------------------------
# One phase in this process; every phase, each in its own


def peak_mib(who: int) -> float:
    """Largest resident set so far, in MiB, of this process (``RUSAGE_SELF``) or of its largest ended child
    (``RUSAGE_CHILDREN``); Linux counts ru_maxrss in KiB."""
    return resource.getrusage(who).ru_maxrss / 1024


def run_phase(name: str, model: str) -> None:
    """Run phase ``name`` here and print its RESULT line."""
    torch.manual_seed(0)
    start = time.perf_counter()
    measured = PHASES[name].run(model)
    result = {
        "seconds": time.perf_counter() - start,
        "peak_mib": peak_mib(resource.RUSAGE_SELF),
        "children_peak_mib": peak_mib(resource.RUSAGE_CHILDREN),
        "bytes_moved": measured.bytes_moved,
        "figure": measured.figure,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def failure_reason(output: str, returncode: int) -> str:
    """The last error line of a failed phase's output (``RuntimeError: ...``; a rank's error comes before the
    phase process's own, often an EOFError from the pipe of the dead rank), else its last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line for line in lines if ERROR_LINE.match(line)]
    return ((errors or lines or [f"exit status {returncode}"])[-1])[:300]


def phase_row(name: str, model: str, timeout: int) -> tuple[str, bool]:
    """Phase ``name`` in a process of its own: its table row, and whether it passed (or was skipped)."""
    missing = [package for package in PHASES[name].needs if importlib.util.find_spec(package) is None]
    if missing:
        return f"| {name} | - | - | - | - | SKIP: {missing[0]} is not importable |", True
    command = [sys.executable, __file__, "--run-phase", name, "--model", model]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return f"| {name} | >{timeout} | - | - | - | FAIL: still running after {timeout} s |", False
    results = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not results:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-6000:])
        reason = failure_reason(done.stdout + done.stderr, done.returncode)
        return f"| {name} | - | - | - | - | FAIL (exit {done.returncode}): {reason} |", False
    result = json.loads(results[-1][len(RESULT_PREFIX) :])
    moved = "-" if result["bytes_moved"] is None else f"{result['bytes_moved']:,}"
    return (
        f"| {name} | {result['seconds']:.1f} | {result['peak_mib']:,.0f} | {result['children_peak_mib']:,.0f} | "
        f"{moved} | {result['figure'].replace('|', ESCAPED_BAR)} |"
    ), True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="2 layers and a 4,096-token vocabulary")
    parser.add_argument("--phases", default=",".join(PHASES), help="comma-separated phases, in this order")
    parser.add_argument("--run-phase", choices=sorted(PHASES), help=argparse.SUPPRESS)  # one phase's own process
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_phase:
        run_phase(args.run_phase, args.model)
        return
    phases = [name for name in args.phases.split(",") if name]
    unknown = [name for name in phases if name not in PHASES]
    if unknown:
        parser.error(f"unknown phase {unknown[0]!r}; valid phases: {', '.join(PHASES)}")
    shape = SMOKE if args.smoke else QWEN_0_5B
    model = str(scale_model_path(shape))
    print(f"model: {model} ({shape.layers} layers, vocabulary {shape.vocabulary:,}, hidden {shape.hidden})")
    print("| phase | seconds | peak RSS MiB | largest child's peak RSS MiB | bytes moved | figures |")
    print("|---|---|---|---|---|---|")
    passed = True
    for name in phases:
        row, ok = phase_row(name, model, SMOKE_TIMEOUT if args.smoke else FULL_TIMEOUT)
        print(row, flush=True)
        passed = passed and ok
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
