"""One base URL for every episode: a call's key says which episode it belongs to, so an agent keeps one client and
swaps its key; and the tool results an external agent sends back are recorded as the built-in loop records calls."""

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from tests.helpers.endpoint import RecordingEngine
from tests.helpers.scripted import ScriptedEngine
from unipg.config.lm import EndpointConfig
from unipg.envs import EnvironmentService
from unipg.envs.tool_env import ToolEnv
from unipg.inference import SamplingParams, TurnOutput
from unipg.observe.rollout_metrics import episode_metrics
from unipg.policy.chat import TurnTemplate
from unipg.sample.agent import AgentLoop
from unipg.sample.agent_thread import AgentThreads
from unipg.sample.endpoint_agents import EndpointPort, ExternalAgent, ExternalAgentLoop, load_agent
from unipg.sample.episode_records import episode_record
from unipg.sample.episodes import PromptEncoder
from unipg.sample.event_loop import EpisodeLoop
from unipg.sample.transcripts import format_transcript, transcript
from unipg.tasks.base import Example
from unipg.tasks.rewards.rules import build_rewards

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = Example("What is 2*3?", "6", "6", {"answer": "6"})
REWARDS = build_rewards([{"name": "math"}])
MESSAGES = [{"role": "user", "content": "What is 2*3?"}]
# a call the calculator answers, one it refuses (a ToolError), then the answer
REPLIES = [
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2*/3"}}</tool_call>',
    "6",
]


def loop_on(policy, port: EndpointPort | None = None, agent_threads: AgentThreads | None = None) -> ExternalAgentLoop:
    engine = RecordingEngine(policy, SamplingParams(), generator=torch.Generator().manual_seed(0), batch_wait=0.005)
    return ExternalAgentLoop(
        engine,
        policy.tokenizer,
        eos_ids=policy.eos_ids,
        endpoint=EndpointConfig(),
        max_tokens=8,
        context_length=policy.context_length,
        describe_tools=True,
        port=port,
        agent_threads=agent_threads,
    )


def play(loop, run, count=1, on=None):
    """``count`` episodes of ``run`` on ``loop``, on the event loop ``on`` (an ``EpisodeLoop``; None: a new one)."""
    episodes = loop.run_episodes([ExternalAgent(run, REWARDS)] * count, [EXAMPLE] * count)
    return (on or EpisodeLoop(keep=False)).run(episodes)


class OneClientAgent:
    """An agent that makes one client per event loop it runs on and, per episode, only swaps its key."""

    def __init__(self):
        self.clients: dict[asyncio.AbstractEventLoop, AsyncOpenAI] = {}
        self.seen: list[tuple[str, str]] = []  # (base_url, api_key) of each episode

    async def __call__(self, base_url, api_key, example):
        self.seen.append((base_url, api_key))
        loop = asyncio.get_running_loop()
        if loop not in self.clients:
            self.clients[loop] = AsyncOpenAI(base_url=base_url, api_key="no key yet", max_retries=0)
        client = self.clients[loop].with_options(api_key=api_key)
        reply = await client.chat.completions.create(model="unipg", messages=MESSAGES, max_tokens=4)
        return {"answer": reply.choices[0].message.content or ""}


def test_a_runs_episodes_share_one_client_and_base_url_and_differ_only_in_their_key(policy):
    """Batches as a runner plays them: on its kept event loop, each serving the endpoint anew on the same port, the
    agents on the runner's agent thread."""
    agent, port, kept, threads = OneClientAgent(), EndpointPort(), EpisodeLoop(), AgentThreads()
    first = play(loop_on(policy, port, threads), agent, count=2, on=kept)
    second = play(loop_on(policy, port, threads), agent, count=1, on=kept)
    kept.close()
    threads.close()
    urls, keys = {url for url, _ in agent.seen}, [key for _, key in agent.seen]
    assert len(urls) == 1 and len(set(keys)) == 3  # one base URL for the run, a key per episode
    assert urls == {f"http://127.0.0.1:{port.port}/v1"}
    assert len(agent.clients) == 1  # its connections outlived the first batch's server, on the same loop
    for trajectory in first + second:  # each episode holds exactly its own call
        assert trajectory.finish == "done" and trajectory.turns == 1 and sum(trajectory.loss_mask) > 0


def test_the_example_agent_keeps_one_client_for_a_runs_batches(policy):
    example = load_agent(f"{ROOT / 'examples' / 'openai_agent' / 'agent.py'}:run")
    clients, port, kept, threads = example.__globals__["CLIENTS"], EndpointPort(), EpisodeLoop(), AgentThreads()
    episodes = [play(loop_on(policy, port, threads), example, count=2, on=kept) for _ in range(2)]
    assert len(clients) == 1 and [t.finish for batch in episodes for t in batch] == ["done"] * 4
    kept.close()
    threads.close()


def test_one_client_reaches_each_session_by_its_key_and_a_wrong_or_ended_key_is_a_401(served):
    sessions, server = served.loop.sessions, served.loop.server
    mine, theirs = sessions.open(), sessions.open()
    client = OpenAI(base_url=server.url, api_key="no key yet", max_retries=0)
    for session in (mine, theirs, mine):
        client.with_options(api_key=session.key).chat.completions.create(model="unipg", messages=MESSAGES, max_tokens=2)
    assert (mine.calls, theirs.calls) == (2, 1)
    sessions.close(theirs)
    refusals = {
        "an ended episode's key": (theirs.key, "belongs to an episode that has ended"),
        "a key never handed out": ("not-a-key", "unknown API key"),
    }
    for key, message in refusals.values():
        with pytest.raises(openai.AuthenticationError, match=message) as refused:
            client.with_options(api_key=key).chat.completions.create(model="unipg", messages=MESSAGES)
        assert refused.value.status_code == 401 and refused.value.body["type"] == "authentication_error"
    unkeyed = httpx.post(f"{server.url}/chat/completions", json={"messages": MESSAGES})
    assert unkeyed.status_code == 401 and "no API key" in unkeyed.json()["error"]["message"]
    assert theirs.calls == 1 and mine.calls == 2  # the refused calls reached no session
    sessions.close(mine)


def builtin_episode(policy):
    """The built-in loop on the calculator environment, the model writing ``REPLIES``."""
    service = EnvironmentService.from_specs([{"name": "calculator"}])
    loop = AgentLoop(
        ScriptedEngine(policy.tokenizer, REPLIES, keep_stop=("</tool_call>",)),
        TurnTemplate(policy.tokenizer),
        PromptEncoder(policy.tokenizer, system_prompt=None, max_length=4096),
        max_turns=4,
        max_new_tokens=64,
        max_total_tokens=4096,
    )
    [trajectory] = asyncio.run(loop.run_episodes([ToolEnv(REWARDS, service)], [EXAMPLE]))
    service.close()
    return trajectory


def test_an_external_agents_tool_results_are_recorded_and_counted_as_the_builtin_loop_does(policy, monkeypatch):
    agent = load_agent(f"{ROOT / 'benchmarks' / 'endpoint.py'}:openai_agent")  # runs the registered calculator
    loop = loop_on(policy)
    replies = iter(REPLIES)

    async def scripted(context_ids, **options):
        text = next(replies)
        tokens = policy.tokenizer(text, add_special_tokens=False)["input_ids"]
        return TurnOutput(tokens, [-0.5] * len(tokens), text, "stop", False, 0)

    monkeypatch.setattr(loop.engine, "generate", scripted)
    [external] = play(loop, agent)
    builtin = builtin_episode(policy)

    calls = [(info.tool, info.arguments, info.tool_status, info.observation) for info in external.infos]
    assert calls[:2] == [
        ("calculator", {"expression": "2*3"}, "ok", "6"),
        ("calculator", {"expression": "2*/3"}, "error", builtin.infos[1].observation),
    ]
    assert calls == [(info.tool, info.arguments, info.tool_status, info.observation) for info in builtin.infos]
    tool_metrics = ("rollout/tool_calls", "rollout/tool_success_rate", "rollout/malformed_call_rate")
    measured = [episode_metrics([episode], "rollout", tools=True) for episode in (external, builtin)]
    assert [[metrics[name] for name in tool_metrics] for metrics in measured] == [[2, 0.5, 0]] * 2
    assert transcript(external)["turns"] == transcript(builtin)["turns"]
    shown = format_transcript(transcript(external))
    assert 'call:      calculator(expression="2*3")\nresult:    6  [ok]' in shown
    record = episode_record(external, update=0)
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert record["messages"][2]["content"] == "6" and record["loss_mask"] == external.loss_mask  # tokens unchanged
