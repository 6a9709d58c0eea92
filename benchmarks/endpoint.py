"""What the OpenAI-compatible endpoint costs: per request, and in episodes per second of a whole agent.

One process, one policy (the warm start of ``configs/calculator_agent.yaml``), one inference engine per row:

- per request: the same greedy 16-token generation, one request at a time, called on the engine directly
  and through ``POST /v1/chat/completions`` with the ``openai`` client; the difference is the endpoint's
  overhead (HTTP, JSON, rendering, session bookkeeping);
- per episode: ``--episodes`` greedy calculator episodes, ``--concurrency`` at once (one session each), played
  by the built-in agent loop, by the same agent written with the ``openai`` client, and by the agents of
  ``examples/``: OpenAI Agents SDK, LangChain and litellm.

``--generation-ms`` adds that many milliseconds to every generate call of the engine (an ``asyncio.sleep``
before it): a stand-in for a model whose generation costs more than the small one's, so that the rows compare
the agents' own cost against a realistic one of the model. ``--embedded`` skips the warm start (the untrained
embedded model: no SFT to run first; its completion rate is about 0).

    python benchmarks/endpoint.py                    # 128 episodes, 64 concurrent sessions
    python benchmarks/endpoint.py --episodes 64 --requests 20
    python benchmarks/endpoint.py --embedded --generation-ms 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "calculator_agent.yaml"
SMOKE = [
    "task.options={digits: 1, num_train: 16, num_test: 4, tool_demonstrations: 1.0}",
    "model.warm_start=false",
    "sample.max_new_tokens=8",
    "agent.max_total_tokens=40",
]


_TLS = ssl.create_default_context()  # built once: loading the CA bundle costs about 0.1 s of CPU per client


async def openai_agent(base_url: str, api_key: str, example) -> str:
    """The built-in calculator loop, written as an external agent with the ``openai`` client: the registered
    calculator tool, described by its own schema and called as the environment calls it."""
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    from unipg.tools.calculator import calculator_tool

    calculator = calculator_tool()
    tools = [calculator.schema()]
    messages = [{"role": "user", "content": example.prompt}]
    async with AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, http_client=DefaultAsyncHttpxClient(verify=_TLS)
    ) as client:
        for _ in range(3):
            reply = (await client.chat.completions.create(model="unipg", messages=messages, tools=tools)).choices[0]
            messages.append(reply.message.model_dump(exclude_none=True))
            if not reply.message.tool_calls:
                break
            for call in reply.message.tool_calls:
                output = call_tool(calculator, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return reply.message.content or ""


def call_tool(tool, arguments: str) -> str:
    """``tool``'s output for a call's JSON ``arguments``; a call the tool cannot take is an error observation, as
    the environment makes it."""
    try:
        parsed = json.loads(arguments)
    except ValueError as error:
        return f"error: the arguments are not JSON ({error})"
    problem = tool.check_arguments(parsed)
    if problem:
        return f"error: {problem}"
    try:
        return str(tool.function(**parsed))
    except Exception as error:  # noqa: BLE001 — the model's bad call (ToolError or worse) is an observation
        return f"error: {error}"


def episodes_per_second(config, task, policy, agent: str | None, examples) -> tuple[float, float]:
    """(episodes/s, completion rate) of one wave of episodes played by ``agent`` (None: the built-in loop)."""
    from unipg.sample.episodes import EpisodeRunner
    from unipg.tasks.rewards.rules import build_rewards

    config = config.model_copy(deep=True)
    config.task.agent = agent
    runner = EpisodeRunner(policy, task, config, build_rewards(config.task.rewards or task.rewards))
    greedy = runner.sampling(greedy=True)
    start = time.perf_counter()
    trajectories = runner.run(examples, generator=torch.Generator().manual_seed(0), params=greedy).trajectories
    seconds = time.perf_counter() - start
    runner.close()
    return len(examples) / seconds, statistics.fmean(t.correct for t in trajectories)


async def request_overhead(policy, runner_engine, requests: int) -> tuple[float, float]:
    """(ms per direct engine call, ms per endpoint call) for the same greedy 16-token generation."""
    from openai import AsyncOpenAI

    from unipg.config.lm import EndpointConfig
    from unipg.sample.endpoint_agents import ExternalAgentLoop

    loop = ExternalAgentLoop(
        runner_engine,
        policy.tokenizer,
        eos_ids=policy.eos_ids,
        endpoint=EndpointConfig(),
        max_tokens=16,
        context_length=policy.context_length,
        describe_tools=False,
    )
    messages = [{"role": "user", "content": "What is 123*456?"}]
    text = policy.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    context = policy.tokenizer(text, add_special_tokens=False)["input_ids"]
    async with loop.running():
        await runner_engine.generate(list(context), max_new_tokens=16)  # warm-up, untimed
        start = time.perf_counter()
        for _ in range(requests):
            await runner_engine.generate(list(context), max_new_tokens=16)
        direct = (time.perf_counter() - start) / requests
        session = loop.sessions.open()
        async with AsyncOpenAI(base_url=loop.server.session_url(session.id), api_key=session.key) as client:
            await client.chat.completions.create(model="unipg", messages=messages, max_tokens=16)  # warm-up
            start = time.perf_counter()
            for _ in range(requests):
                await client.chat.completions.create(model="unipg", messages=messages, max_tokens=16)
            served = (time.perf_counter() - start) / requests
    return direct * 1000, served * 1000


def add_generation_cost(milliseconds: float) -> None:
    """Every generate call of the hf engine waits ``milliseconds`` first (module docstring)."""
    from unipg.inference import HFService

    generate = HFService.generate

    async def costly_generate(self, context_ids, **options):
        await asyncio.sleep(milliseconds / 1000)
        return await generate(self, context_ids, **options)

    HFService.generate = costly_generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=128, help="episodes per row")
    parser.add_argument("--concurrency", type=int, default=64, help="episodes (sessions) at once")
    parser.add_argument("--requests", type=int, default=40, help="sequential requests of the overhead rows")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, no warm start: checks the script runs")
    parser.add_argument("--embedded", action="store_true", help="the untrained embedded model (no warm start)")
    parser.add_argument("--generation-ms", type=float, default=0.0, help="added cost of every generate call (ms)")
    args = parser.parse_args()
    from unipg.config import load_config
    from unipg.inference import SamplingParams
    from unipg.learn.warm_start import resolve_warm_start
    from unipg.policy.loading import policy_from_config
    from unipg.sample.episodes import EpisodeRunner
    from unipg.tasks.base import make_task

    episodes, concurrency, requests = (8, 4, 3) if args.smoke else (args.episodes, args.concurrency, args.requests)
    overrides = [*(SMOKE if args.smoke else []), *(["model.warm_start=false"] if args.embedded else [])]
    config = load_config(CONFIG, [*overrides, f"agent.concurrency={concurrency}"])
    task = make_task(config.task.name, **config.task.options)
    config = resolve_warm_start(config, task, log=lambda line: None)
    policy = policy_from_config(config)
    examples = [task.test[index % len(task.test)] for index in range(episodes)]
    engine = EpisodeRunner(policy, task, config, None).inference_service(None, params=SamplingParams(temperature=0.0))
    direct, served = asyncio.run(request_overhead(policy, engine, requests))
    print(
        f"per request ({requests} sequential greedy 16-token calls): engine {direct:.1f} ms, "
        f"endpoint {served:.1f} ms, overhead {served - direct:.1f} ms"
    )
    if args.generation_ms:
        add_generation_cost(args.generation_ms)
    cost = f", every generate call {args.generation_ms:g} ms slower (--generation-ms)" if args.generation_ms else ""
    print(f"\n{episodes} greedy calculator episodes, {concurrency} at once{cost}\n")
    print("| agent | episodes/s | vs built-in | completion rate |")
    print("|---|---|---|---|")
    rows = [
        ("built-in agent loop", None),
        ("openai client agent", f"{__file__}:openai_agent"),
        ("OpenAI Agents SDK agent", f"{ROOT / 'examples' / 'openai_agent' / 'agent.py'}:run"),
        ("LangChain agent", f"{ROOT / 'examples' / 'langchain_agent' / 'agent.py'}:run"),
        ("litellm agent", f"{ROOT / 'examples' / 'litellm_agent' / 'agent.py'}:run"),
    ]
    baseline = None
    for name, agent in rows:
        rate, completion = episodes_per_second(config, task, policy, agent, examples)
        baseline = baseline or rate
        print(f"| {name} | {rate:.2f} | {rate / baseline - 1:+.0%} | {completion:.2f} |")


if __name__ == "__main__":
    main()
