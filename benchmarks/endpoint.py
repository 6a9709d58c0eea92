"""What the OpenAI-compatible endpoint costs: per request, and in episodes per second of a whole agent.

One process, one policy, one inference engine per row. The policy is the warm start of
``configs/calculator_agent.yaml`` fine-tuned on tool demonstrations only (``task.options.tool_demonstrations=1.0``),
so that every greedy episode is the same three steps whichever agent plays it: a calculator call, the tool's
result, the answer. (The main job's warm start mostly answers at once, so an agent that forces a tool call would
play longer episodes than one that does not, and the rows would not compare the same work.)

- per request: the same greedy 16-token generation, one request at a time, called on the engine directly
  and through ``POST /v1/chat/completions`` with the ``openai`` client; the difference is the endpoint's
  overhead (HTTP, JSON, rendering, session bookkeeping);
- per episode: ``--episodes`` greedy calculator episodes, ``--concurrency`` at once (one session each), played
  by the built-in agent loop, by the same agent written with the ``openai`` client, and by the agents of
  ``examples/``: OpenAI Agents SDK, LangChain and litellm.

``--generation-ms`` makes every generate call of the engine (one batched ``LMPolicy.sample`` call, however
many requests it serves) that many milliseconds longer, a ``time.sleep`` on the engine's worker thread that
releases the GIL as a GPU's kernels do: a stand-in for a model whose generation costs more than the small one's,
so that the rows compare the agents' own cost against a realistic one of the model. An agent that splits the
engine's batches into more calls pays it more often. ``--embedded`` skips the warm start (the untrained
embedded model: no SFT to run first; its completion rate is about 0). ``--engine vllm`` plays every row on the
vllm engine (continuous batching: a request joins the running batch at the next step instead of waiting for a
whole wave); its stand-in for a larger model is ``--step-ms``, the same sleep added to every engine step (one
token for every request in flight), since ``--generation-ms`` counts the hf engine's generate calls, which vllm has
not.

    python benchmarks/endpoint.py                    # 128 episodes, 64 concurrent sessions
    python benchmarks/endpoint.py --episodes 64 --requests 20
    python benchmarks/endpoint.py --embedded --generation-ms 50
    python benchmarks/endpoint.py --engine vllm
    python benchmarks/endpoint.py --engine vllm --step-ms 25
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import statistics
import time
import weakref
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


CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, object] = weakref.WeakKeyDictionary()


async def openai_agent(base_url: str, api_key: str, example) -> str:
    """The built-in calculator loop, written as an external agent with the ``openai`` client: the registered
    calculator tool, described by its own schema and called as the environment calls it. One client per event
    loop (``docs/agents.md``), each episode a copy with its own key."""
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    from unipg.tools.calculator import calculator_tool

    loop = asyncio.get_running_loop()
    if loop not in CLIENTS:
        CLIENTS[loop] = AsyncOpenAI(
            base_url=base_url,
            api_key="set per episode",
            max_retries=0,
            http_client=DefaultAsyncHttpxClient(verify=_TLS),
        )
    client = CLIENTS[loop].with_options(api_key=api_key)
    calculator = calculator_tool()
    tools = [calculator.schema()]
    messages = [{"role": "user", "content": example.prompt}]
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


def episodes_per_second(config, task, policy, agent: str | None, examples, processes: int) -> tuple[float, float]:
    """(episodes/s, completion rate) of one wave of episodes played by ``agent`` (None: the built-in loop) in
    ``processes`` worker processes (0: on the agents' thread). Two episodes first, untimed, for every row: a
    runner's workers start (and import the agent) once for a whole run, so their start is no cost per episode."""
    from unipg.sample.episodes import EpisodeRunner
    from unipg.tasks.rewards.rules import build_rewards

    config = config.model_copy(deep=True)
    config.task.agent = agent
    config.endpoint.agent_processes = processes
    runner = EpisodeRunner(policy, task, config, build_rewards(config.task.rewards or task.rewards))
    greedy = runner.sampling(greedy=True)
    runner.run(examples[:2], generator=torch.Generator().manual_seed(0), params=greedy)
    start = time.perf_counter()
    trajectories = runner.run(examples, generator=torch.Generator().manual_seed(0), params=greedy).trajectories
    seconds = time.perf_counter() - start
    runner.close()
    return len(examples) / seconds, statistics.fmean(t.correct for t in trajectories)


async def request_overhead(policy, runner_engine, requests: int) -> tuple[float, float]:
    """(ms per direct engine call, ms per endpoint call), medians of ``requests`` calls each, alternating, of the
    same greedy 16-token generation."""
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
        session = loop.sessions.open()
        async with AsyncOpenAI(base_url=loop.server.url, api_key=session.key) as client:

            async def direct():
                await runner_engine.generate(list(context), max_new_tokens=16)

            async def served():
                await client.chat.completions.create(model="unipg", messages=messages, max_tokens=16)

            seconds: dict = {direct: [], served: []}
            for round_ in range(requests + 1):  # alternating, so that the machine's load reaches both alike
                for call in (direct, served):
                    start = time.perf_counter()
                    await call()
                    if round_:  # the first round warms up
                        seconds[call].append(time.perf_counter() - start)
    return statistics.median(seconds[direct]) * 1000, statistics.median(seconds[served]) * 1000


def slow_down(owner: type, method: str, milliseconds: float) -> None:
    """``owner.method`` sleeps ``milliseconds`` before it runs: the hf engine's generate call or the vllm engine's
    step (module docstring)."""
    run = getattr(owner, method)

    def slower(self, *args, **options):
        time.sleep(milliseconds / 1000)  # on the engine's own thread, the GIL released as while CUDA kernels run
        return run(self, *args, **options)

    setattr(owner, method, slower)


def add_cost(args: argparse.Namespace) -> str:
    """Adds ``--generation-ms`` or ``--step-ms`` to the engine; what it added, for the table's heading."""
    from unipg.inference import HFService
    from unipg.inference.vllm_core import StepLoop

    if args.generation_ms:
        slow_down(HFService, "_sample", args.generation_ms)
        return f", every generate call {args.generation_ms:g} ms slower (--generation-ms)"
    if args.step_ms:
        slow_down(StepLoop, "_step", args.step_ms)
        return f", every engine step {args.step_ms:g} ms slower (--step-ms)"
    return ""


def overrides(args: argparse.Namespace) -> list[str]:
    """The overrides of ``configs/calculator_agent.yaml`` that every row shares."""
    return [
        "task.options.tool_demonstrations=1.0",
        f"sample.engine={args.engine}",
        *(SMOKE if args.smoke else []),
        *(["model.warm_start=false"] if args.embedded else []),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=128, help="episodes per row")
    parser.add_argument("--concurrency", type=int, default=64, help="episodes (sessions) at once")
    parser.add_argument("--requests", type=int, default=40, help="sequential requests of the overhead rows")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of every row; each row's best is shown")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, no warm start: checks the script runs")
    parser.add_argument("--embedded", action="store_true", help="the untrained embedded model (no warm start)")
    parser.add_argument("--generation-ms", type=float, default=0.0, help="added cost of every generate call (ms)")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="sample.engine of every row")
    parser.add_argument("--step-ms", type=float, default=0.0, help="added cost of every vllm engine step (ms)")
    parser.add_argument(
        "--agent-processes", type=int, default=1, help="endpoint.agent_processes of the external agents (0: a thread)"
    )
    args = parser.parse_args()
    if args.generation_ms and args.engine != "hf":
        parser.error("--generation-ms adds its cost to the hf engine's generate calls: use --step-ms with vllm")
    if args.step_ms and args.engine != "vllm":
        parser.error("--step-ms adds its cost to the vllm engine's steps: use --generation-ms with hf")
    from unipg.config import load_config
    from unipg.inference import SamplingParams
    from unipg.learn.warm_start import resolve_warm_start
    from unipg.policy.loading import policy_from_config
    from unipg.sample.episodes import EpisodeRunner
    from unipg.tasks.base import make_task

    episodes, concurrency, requests = (8, 4, 3) if args.smoke else (args.episodes, args.concurrency, args.requests)
    args.rounds = 1 if args.smoke else args.rounds
    config = load_config(CONFIG, [*overrides(args), f"agent.concurrency={concurrency}"])
    task = make_task(config.task.name, **config.task.options)
    config = resolve_warm_start(config, task, log=lambda line: None)
    policy = policy_from_config(config)
    examples = [task.test[index % len(task.test)] for index in range(episodes)]
    engine = EpisodeRunner(policy, task, config, None).inference_service(None, params=SamplingParams(temperature=0.0))
    direct, served = asyncio.run(request_overhead(policy, engine, requests))
    print(
        f"per request (median of {requests} sequential greedy 16-token calls each): engine {direct:.1f} ms, "
        f"endpoint {served:.1f} ms, overhead {served - direct:.1f} ms"
    )
    cost = add_cost(args)
    where = f"in {args.agent_processes} worker process(es)" if args.agent_processes else "on the agents' thread"
    print(
        f"\n{episodes} greedy calculator episodes on the {args.engine} engine, {concurrency} at once{cost}, "
        f"external agents {where} (endpoint.agent_processes), best of {args.rounds} rounds\n"
    )
    print("| agent | episodes/s | / built-in | completion rate |")
    print("|---|---|---|---|")
    rows = [
        ("built-in agent loop", None),
        ("openai client agent", f"{__file__}:openai_agent"),
        ("OpenAI Agents SDK agent", f"{ROOT / 'examples' / 'openai_agent' / 'agent.py'}:run"),
        ("LangChain agent", f"{ROOT / 'examples' / 'langchain_agent' / 'agent.py'}:run"),
        ("litellm agent", f"{ROOT / 'examples' / 'litellm_agent' / 'agent.py'}:run"),
    ]
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):  # every row once a round, so that the machine's load reaches each alike
        for name, agent in rows:
            processes = args.agent_processes if agent is not None else 0
            rate, completion = episodes_per_second(config, task, policy, agent, examples, processes)
            best[name] = max(best.get(name, (0.0, 0.0)), (rate, completion))
    baseline = best[rows[0][0]][0]
    for name, _ in rows:
        rate, completion = best[name]
        print(f"| {name} | {rate:.2f} | {rate / baseline:.2f}× | {completion:.2f} |")


if __name__ == "__main__":
    main()
