"""Inference engines side by side: unipg on ``hf``, unipg on ``vllm``, and vLLM alone (the same requests sent
straight to vLLM, without unipg), on the embedded model, in one process: the two unipg engines take turns pass by
pass (hf's requests, then vllm's), vLLM alone runs last (one vLLM engine per process).

Printed per engine:

- single-turn: ``--prompts`` prompts × ``--new-tokens`` sampled tokens each (end tokens ignored, so every
  engine samples exactly as many), all submitted at once; generated tokens per second;
- multi-turn: ``--episodes`` concurrent agent episodes of ``--turns`` turns (``--turn-tokens`` per turn), whose
  environment answers after a seeded log-normal delay (median ``--latency`` s, log-space σ ``--sigma``: heavy-
  tailed); episodes per second, and context tokens the engine ran per turn (prefill: hf runs every turn's
  whole context, vLLM reuses the cached prefix of earlier turns);
- every figure the best of ``--passes`` passes after a first, unmeasured one (vLLM on CPU prepares kernels per
  batch shape on first use); the machine's load moves single passes by tens of percent;
- model load (hf: the policy; vllm: start-up of the engine on it; vLLM alone: its ``LLM``) and weight sync
  (one new version into the engine: hf ``load_state_dict`` into the sampling copy, vllm ``reload_weights``);
- multi-turn CPU time per episode (this process's, all its threads; the least of the measured passes): what an
  engine costs whatever share of the cores the machine's other work leaves it;
- the thread settings each engine's passes ran under (torch's threads, the process's CPU affinity, OpenMP's
  environment), so a setting vLLM's start-up changed would show as a difference between the two rows.

    python benchmarks/engines.py                                   # 256 × 128 single-turn, 64 × 4-turn episodes
    python benchmarks/engines.py --prompts 16 --new-tokens 16 --episodes 8 --turns 2   # a quick check
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import os
import random
import time

import torch

from unipg.config import load_config
from unipg.envs.base import StepResult
from unipg.inference import ENGINES, SamplingParams
from unipg.policy.chat import TurnTemplate
from unipg.policy.loading import load_lm_policy
from unipg.sample.agent import AgentLoop
from unipg.tasks.base import Example


class SlowToolEnv:
    """Answers every turn after a log-normal delay, ends the episode after ``turns`` turns."""

    observation_role = "tool"

    def __init__(self, turns: int, delays: list[float]):
        self.turns, self.delays, self.turn = turns, delays, 0

    async def reset(self, example):
        return example.prompt

    async def step(self, action):
        await asyncio.sleep(self.delays[self.turn])
        self.turn += 1
        return StepResult(f"result {self.turn}: 42", 0.0, self.turn >= self.turns, {})


def prompt_ids(policy, count: int) -> list[list[int]]:
    return [
        policy.tokenizer(f"<|user|>Question {i}: what is {i} * {i + 7}?<|end|><|assistant|>")["input_ids"]
        for i in range(count)
    ]


def single_turn(service, prompts: list[list[int]], new_tokens: int) -> float:
    """Generated tokens per second, every prompt submitted at once."""

    async def run():
        async with service.running():
            start = time.perf_counter()
            outputs = await asyncio.gather(
                *(service.generate(p, max_new_tokens=new_tokens, order=i) for i, p in enumerate(prompts))
            )
            return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)

    return asyncio.run(run())


def multi_turn(service, policy, args) -> tuple[float, float, float]:
    """Episodes per second, prefill tokens per turn and this process's CPU milliseconds per episode."""
    rng = random.Random(args.seed)
    delays = [
        [args.latency * rng.lognormvariate(0.0, args.sigma) for _ in range(args.turns)] for _ in range(args.episodes)
    ]
    envs = [SlowToolEnv(args.turns, d) for d in delays]
    examples = [Example(policy.decode(ids), "", "") for ids in prompt_ids(policy, args.episodes)]
    encode = lambda text: policy.tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    loop = AgentLoop(
        service,
        TurnTemplate(policy.tokenizer),
        encode,
        max_turns=args.turns,
        max_new_tokens=args.turn_tokens,
        max_total_tokens=400,
        context_length=policy.context_length,
    )
    start, cpu = time.perf_counter(), time.process_time()
    asyncio.run(loop.run_episodes(envs, examples))
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return args.episodes / seconds, service.prefill_tokens / max(service.turns, 1), 1000 * cpu / args.episodes


def thread_settings() -> str:
    """What decides how this process's engines use the cores: torch's intra-op and inter-op threads, the CPU
    affinity, and the OpenMP variables (vLLM sets them for the worker processes it spawns)."""
    openmp = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("OMP_", "KMP_", "GOMP_"))}
    return (
        f"torch threads {torch.get_num_threads()} (inter-op {torch.get_num_interop_threads()}), "
        f"CPUs {sorted(os.sched_getaffinity(0))}, OpenMP environment {openmp or 'unset'}"
    )


def start_engine(name: str, policy, config, args):
    """The engine and its load seconds (hf: the policy's; vllm: its start-up on the policy's model)."""
    start = time.perf_counter()
    engine = ENGINES.get(name)(policy, config)
    return engine, time.perf_counter() - start + args.policy_load


def unipg_engines(policy, config, args) -> dict[str, dict[str, float]]:
    """``hf`` and ``vllm`` side by side: each pass runs every engine's single-turn requests, then every engine's
    episodes, so a change of the machine's load between passes moves both rows, not their ratio."""
    engines, rows = {}, {}
    settings = {"hf": set(), "vllm": set()}
    try:
        for name in ("hf", "vllm"):
            engines[name], load = start_engine(name, policy, config, args)
            rows[name] = {"load s": load}
        params = SamplingParams(temperature=1.0)
        generators = {name: torch.Generator().manual_seed(args.seed) for name in engines}

        def service(name: str):  # the same sampling and batching settings for both engines
            return engines[name].service(params, generators[name], batch_wait=0.005, max_batch=1024)

        for measured in [False] + [True] * args.passes:  # the first pass warms up (vLLM on CPU: kernels per shape)
            for name in engines:
                tokens = single_turn(service(name), prompt_ids(policy, args.prompts), args.new_tokens)
                keep_best(rows[name], "tokens/s", tokens, measured)
            for name in engines:
                settings[name].add(thread_settings())
                episodes, rows[name]["prefill/turn"], cpu = multi_turn(service(name), policy, args)
                keep_best(rows[name], "episodes/s", episodes, measured)
                keep_best(rows[name], "cpu ms/ep", cpu, measured, best=min)
        for name, engine in engines.items():
            rows[name]["sync s"] = weight_sync(name, engine, policy)
            print(f"unipg {name} ran its passes under: {'; '.join(sorted(settings[name]))}")
    finally:
        for engine in engines.values():
            engine.close()
    return {f"unipg {name}": row for name, row in rows.items()}


def keep_best(row: dict[str, float], column: str, value: float, measured: bool, best=max) -> None:
    if measured:
        row[column] = best(row[column], value) if column in row else value


def weight_sync(name: str, engine, policy) -> float:
    """Seconds to take one new version of the weights (mean of 3)."""
    if name == "hf":  # the concurrent schedule's copy takes a snapshot of the learner's weights
        target = copy.deepcopy(policy.model)
        start = time.perf_counter()
        for _ in range(3):
            target.load_state_dict({k: v.clone() for k, v in policy.model.state_dict().items()})
        return (time.perf_counter() - start) / 3
    start = time.perf_counter()
    for version in range(1, 4):
        asyncio.run(engine.core.load(version, policy.model))
    return (time.perf_counter() - start) / 3


def vllm_alone(policy, config, args) -> dict[str, float]:
    """The single-turn requests sent straight to a vLLM ``LLM`` with the same engine settings."""
    from unipg.inference.vllm_setup import engine_args, import_vllm

    vllm = import_vllm()
    from unipg.policy.embedded import resolve_model_name

    folder = resolve_model_name(config.model.name)
    start = time.perf_counter()
    settings = vars(engine_args(folder, policy, config.sample, dtype="float32", seed=args.seed, lora_rank=0))
    llm = vllm.LLM(
        **{
            k: v
            for k, v in settings.items()
            if k
            in (
                "model",
                "tokenizer",
                "dtype",
                "seed",
                "max_model_len",
                "enable_prefix_caching",
                "logprobs_mode",
                "enforce_eager",
                "kv_cache_memory_bytes",
                "gpu_memory_utilization",
                "block_size",
                "enable_chunked_prefill",
            )
        },
        disable_log_stats=True,
    )
    load = time.perf_counter() - start
    params = vllm.SamplingParams(
        max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, logprobs=0, seed=args.seed
    )
    row = {"load s": load}
    for measured in [False] + [True] * args.passes:  # the first pass warms up, as for the unipg engines
        start = time.perf_counter()
        outputs = llm.generate(
            [{"prompt_token_ids": ids} for ids in prompt_ids(policy, args.prompts)], params, use_tqdm=False
        )
        keep_best(
            row, "tokens/s", sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start), measured
        )
    llm.llm_engine.engine_core.shutdown()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=32)
    parser.add_argument("--latency", type=float, default=0.05, help="median tool delay, seconds")
    parser.add_argument("--sigma", type=float, default=1.2, help="log-space σ of the tool delay")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--passes", type=int, default=3, help="measured passes (after a warm-up); best one shown")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (as vLLM serves on CPU; more threads than free cores make every engine spin)",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="unipg's vllm engine compiled (sample.vllm_enforce_eager=false; one vLLM engine per run and process)",
    )
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: check that the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.prompts, args.new_tokens, args.episodes, args.turns, args.turn_tokens, args.latency = 8, 8, 4, 2, 8, 0.001
        args.passes = 1
    torch.set_num_threads(args.threads)
    print(f"before the engines start: {thread_settings()}")
    compiled = ["sample.vllm_enforce_eager=false"] if args.compiled else []
    config = load_config(
        overrides=[f"model.name={args.model}", "sample.cpu_kv_cache_gb=0.5", f"seed={args.seed}", *compiled]
    )
    start = time.perf_counter()
    policy = load_lm_policy(args.model)
    args.policy_load = time.perf_counter() - start
    policy.eos_ids = []  # every engine samples exactly --new-tokens / --turn-tokens tokens
    results = {**unipg_engines(policy, config, args), "vLLM alone": vllm_alone(policy, config, args)}
    columns = ["tokens/s", "episodes/s", "cpu ms/ep", "prefill/turn", "load s", "sync s"]
    print(f"\n{'engine':<22}" + "".join(f"{c:>14}" for c in columns))
    for name, row in results.items():
        print(f"{name:<22}" + "".join(f"{row[c]:>14.3f}" if c in row else f"{'-':>14}" for c in columns))
    hf, vl, alone = results["unipg hf"], results["unipg vllm"], results["vLLM alone"]
    print(
        f"\nvllm / hf tokens/s: {vl['tokens/s'] / hf['tokens/s']:.2f}×   vllm / hf episodes/s: "
        f"{vl['episodes/s'] / hf['episodes/s']:.2f}×   unipg vllm / vLLM alone tokens/s: "
        f"{vl['tokens/s'] / alone['tokens/s']:.0%}"
    )
    print(f"unipg vllm and vLLM alone ran {'compiled' if args.compiled else 'eagerly'}")


if __name__ == "__main__":
    main()
