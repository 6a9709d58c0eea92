"""The vllm engine, for real (vLLM on CPU with the embedded model): log-probs equal to the trainer's, the agent
loop unchanged, weights by version (full and LoRA), and nothing left running after close.

One engine serves the whole module (starting vLLM takes tens of seconds); a second, with LoRA, its one test.
"""

import asyncio
import json
import os
import threading
from pathlib import Path

import jsonschema
import pytest
import torch

from tests.inference.test_structured import masked_logprobs
from unipg.config import load_config
from unipg.inference import SamplingParams
from unipg.policy.loading import load_lm_policy
from unipg.sample.episodes import EpisodeRunner
from unipg.tasks.base import make_task
from unipg.tasks.rewards.rules import build_rewards

pytest.importorskip("vllm")

CALCULATOR = [
    "task.name=calculator",
    "task.options={digits: 1, num_train: 8, num_test: 2}",
    "sample.engine=vllm",
    "sample.max_new_tokens=24",
    "agent.max_total_tokens=80",
    "sample.cpu_kv_cache_gb=0.125",
]


def child_processes() -> list[int]:
    """Ids of the live processes whose parent is this one (from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid():
                children.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return children


def make_runner(policy, overrides=()):
    config = load_config(overrides=[*CALCULATOR, *overrides])
    task = make_task(config.task.name, **config.task.options)
    return EpisodeRunner(policy, task, config, build_rewards(config.task.rewards or task.rewards))


@pytest.fixture(scope="module")
def policy(tiny_policy):
    return tiny_policy()


@pytest.fixture(scope="module")
def runner(policy):
    runner = make_runner(policy)
    runner.children_before = set(child_processes())  # e.g. helper processes earlier tests left running
    runner.engine  # noqa: B018 — start vLLM once for the module
    yield runner
    runner.close()


def generate(runner, contexts, *, version=0, temperature=1.0, max_new_tokens=16, seed=0, params=None):
    sampling = SamplingParams(temperature=temperature)
    service = runner.inference_service(torch.Generator().manual_seed(seed), params=sampling)
    service.policy_version = version

    async def go():
        async with service.running():
            return await asyncio.gather(
                *(service.generate(c, max_new_tokens=max_new_tokens, params=params) for c in contexts)
            )

    return asyncio.run(go())


def trainer_logprobs(policy, context, tokens, temperature):
    with torch.no_grad():
        logits = policy.model(torch.tensor([context + tokens])).logits[0, len(context) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


def prompts(policy, count=6):
    return [policy.tokenizer(f"<|user|>What is {i} + {i * 3}?<|end|><|assistant|>")["input_ids"] for i in range(count)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_the_trainers_forward(runner, policy, temperature):
    outputs = generate(runner, prompts(policy), temperature=temperature)
    assert all(out.engine == "vllm" and out.policy_version == 0 for out in outputs)
    for context, out in zip(prompts(policy), outputs):
        assert len(out.behaviour_logprobs) == len(out.token_ids) > 0
        expected = trainer_logprobs(policy, context, out.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(out.behaviour_logprobs), expected, atol=1e-3, rtol=0)
        assert out.text == policy.decode(out.token_ids)  # no stop strings: the whole turn, special tokens removed


def test_same_seed_same_tokens(runner, policy):
    first, second = generate(runner, prompts(policy), seed=3), generate(runner, prompts(policy), seed=3)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


def test_a_requests_own_seed_decides_its_tokens_whatever_the_services_generator(runner, policy):
    seeded = SamplingParams(seed=11)
    first = generate(runner, prompts(policy, 2), seed=1, params=seeded)
    second = generate(runner, prompts(policy, 2), seed=2, params=seeded)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    unseeded = [generate(runner, prompts(policy, 2), seed=seed) for seed in (1, 2)]
    assert [o.token_ids for o in unseeded[0]] != [o.token_ids for o in unseeded[1]]  # the generator's seeds differ


def test_a_requests_own_stop_strings_cut_its_text(runner, policy):
    [whole] = generate(runner, prompts(policy, 1), seed=5)
    stop = next(character for character in whole.text[1:] if not character.isspace())
    [cut] = generate(runner, prompts(policy, 1), seed=5, params=SamplingParams(stop=[stop]))
    assert stop not in cut.text and whole.text.startswith(cut.text)


def test_a_json_schema_reply_matches_it_and_its_logprobs_are_the_masked_distributions(runner, policy):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    text = json.dumps(schema, sort_keys=True)
    contexts = prompts(policy, 2)
    outputs = generate(runner, contexts, params=SamplingParams(json_schema=text), max_new_tokens=24)
    for context, out in zip(contexts, outputs):
        jsonschema.validate(json.loads(out.text), schema)
        assert out.finish_reason == "stop" and out.ended_with_eos
        # vLLM's grammar (xgrammar, compact JSON) leaves special tokens in strings; the hf engine masks them
        expected = masked_logprobs(policy, context, out.token_ids, text, 1.0, specials_masked=False)
        torch.testing.assert_close(torch.tensor(out.behaviour_logprobs), expected, atol=1e-3, rtol=0)


def test_calculator_agent_runs_unchanged_on_vllm(runner):
    examples = runner.task.train[:2]
    episodes = runner.run(examples, generator=torch.Generator().manual_seed(0), policy_version=0)
    trajectories = episodes.trajectories
    assert len(trajectories) == 2
    for trajectory in trajectories:
        assert trajectory.turns >= 1 and len(trajectory.policy_versions) == trajectory.turns
        sampled = [lp for lp, m in zip(trajectory.behaviour_logprobs, trajectory.loss_mask) if m]
        assert len(sampled) == sum(trajectory.loss_mask) > 0 and all(lp <= 0 for lp in sampled)
    sizes, seconds = episodes.batch_sizes, episodes.generate_seconds
    assert sizes and seconds > 0


def test_a_weight_update_changes_the_next_generation_and_its_version(runner, policy):
    contexts = prompts(policy, 3)
    before = generate(runner, contexts, temperature=1.0, seed=5)
    saved = {name: tensor.clone() for name, tensor in policy.model.state_dict().items()}
    try:
        with torch.no_grad():
            for name, parameter in policy.model.named_parameters():
                if "mlp" in name:
                    parameter.mul_(1.5)
        after = generate(runner, contexts, version=1, temperature=1.0, seed=5)
        assert all(out.policy_version == 1 for out in after)
        assert runner.engine.version == 1
        for context, old, new in zip(contexts, before, after):
            expected = trainer_logprobs(policy, context, new.token_ids, 1.0)  # the updated weights' log-probs
            torch.testing.assert_close(torch.tensor(new.behaviour_logprobs), expected, atol=1e-3, rtol=0)
        changed = [old.behaviour_logprobs[0] != new.behaviour_logprobs[0] for old, new in zip(before, after)]
        assert any(changed)
        assert runner.pop_engine_metrics()["engine/weight_syncs"] >= 1
    finally:
        policy.model.load_state_dict(saved)


def test_a_weight_load_with_partial_rollouts_interrupts_a_turn_that_goes_on_under_the_new_weights(
    runner, policy, monkeypatch
):
    core = runner.engine.core
    monkeypatch.setattr(core, "partial", True)
    monkeypatch.setattr(policy, "eos_ids", [])  # the turn runs to its budget: the load always lands inside it
    reached, release, steps = threading.Event(), threading.Event(), []
    step = core.llm.step

    def gated_step():  # the engine's own step; after its fourth, the test queues the load before the fifth
        outputs = step()
        steps.append(len(outputs))
        if len(steps) == 4:
            reached.set()
            release.wait(120)
        return outputs

    monkeypatch.setattr(core.llm, "step", gated_step)
    context = prompts(policy, 1)[0]
    saved = {name: tensor.clone() for name, tensor in policy.model.state_dict().items()}
    service = runner.inference_service(torch.Generator().manual_seed(3), params=SamplingParams(temperature=1.0))
    service.policy_version = core.version + 1  # the policy's own weights, loaded when the service starts
    old = service.policy_version

    async def go():
        async with service.running():
            turn = asyncio.create_task(service.generate(context, max_new_tokens=20))
            await asyncio.to_thread(reached.wait, 120)
            with torch.no_grad():
                for name, parameter in policy.model.named_parameters():
                    if "mlp" in name:
                        parameter.mul_(1.5)
            load = asyncio.create_task(core.load(old + 1, policy.model))
            await asyncio.sleep(0)  # the load's call is queued behind the gated step
            release.set()
            await load
            return await turn

    try:
        out = asyncio.run(go())
        assert len(out.token_ids) == len(out.behaviour_logprobs) == 20
        assert out.policy_version == old and out.version_changes == ((4, old + 1),)
        assert core.metrics()["engine/turns_interrupted"] == 1
        new = trainer_logprobs(policy, context, out.token_ids, 1.0)
    finally:
        policy.model.load_state_dict(saved)
    before = trainer_logprobs(policy, context, out.token_ids, 1.0)
    logprobs = torch.tensor(out.behaviour_logprobs)
    torch.testing.assert_close(logprobs[:4], before[:4], atol=1e-3, rtol=0)  # sampled by the old weights
    torch.testing.assert_close(logprobs[4:], new[4:], atol=1e-3, rtol=0)  # and the rest by the new ones
    assert not torch.allclose(before[4:], new[4:], atol=1e-3)


def test_an_episode_that_raises_leaves_the_engine_serving(runner, policy):
    class Broken:
        observation_role = "tool"

        async def reset(self, example):
            return example.prompt

        async def step(self, action):
            raise RuntimeError("environment broke")

    loop = runner.agent_loop(runner.inference_service(torch.Generator().manual_seed(0), params=SamplingParams()))
    examples = runner.task.train[:2]
    with pytest.raises(RuntimeError, match="environment broke"):
        asyncio.run(loop.run_episodes([Broken(), Broken()], examples))
    assert runner.engine.core.loop._thread.is_alive()
    assert len(generate(runner, prompts(policy, 2))) == 2


def test_engine_memory_keys_are_accepted_and_checked():
    config = load_config(
        overrides=["sample.engine=vllm", "sample.gpu_memory_utilization=0.3", "sample.engine_sleep=true"]
    )
    assert config.sample.gpu_memory_utilization == 0.3 and config.sample.engine_sleep
    for bad in ("sample.gpu_memory_utilization=1.5", "sample.cpu_kv_cache_gb=0"):
        with pytest.raises(Exception, match="sample"):
            load_config(overrides=[bad])


def test_no_thread_or_process_of_the_engine_is_left_after_close(runner):
    engine = runner.engine
    thread = engine.core.loop._thread
    runner.close()
    assert not thread.is_alive()
    assert set(child_processes()) <= runner.children_before


def test_lora_adapters_move_by_version_and_match_the_trainer(embedded_path):
    policy = load_lm_policy(embedded_path, lora_rank=4)
    children_before = set(child_processes())
    runner = make_runner(policy, ["model.lora_rank=4"])
    try:
        context = prompts(policy, 1)
        [before] = generate(runner, context, seed=1)
        outputs = []
        for version, (part, change) in enumerate([("lora_B", 0.5), ("lora_A", -1.0)], start=1):
            with torch.no_grad():  # B is zero at initialisation: the adapter starts as the identity
                for name, parameter in policy.model.named_parameters():
                    if part in name:
                        parameter.add_(change) if part == "lora_B" else parameter.mul_(change)
            [out] = generate(runner, context, version=version, seed=1)
            assert out.policy_version == version
            assert runner.engine.core.current_adapter().lora_int_id == version + 1  # a new id per version
            expected = trainer_logprobs(policy, context[0], out.token_ids, 1.0)  # this version's, not a cached one
            torch.testing.assert_close(torch.tensor(out.behaviour_logprobs), expected, atol=1e-3, rtol=0)
            outputs.append(out)
        assert len({tuple(out.behaviour_logprobs) for out in (before, *outputs)}) == 3  # each version its own
    finally:
        runner.close()
    assert set(child_processes()) <= children_before


def test_a_sleeping_vllm_engine_hands_torchs_cached_gpu_memory_back_before_it_wakes(monkeypatch):
    """The learner's freed CUDA blocks stay in torch's cache; vLLM allocates outside it, so they go back first."""
    import asyncio
    import concurrent.futures
    from types import SimpleNamespace

    from unipg.inference.vllm import VLLMEngine

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))

    def call(function):
        future = concurrent.futures.Future()
        future.set_result(function())
        return future

    engine = SimpleNamespace(
        _serving=0,
        _sleeping=True,
        loop=SimpleNamespace(call=call, wait=lambda future, waiting: asyncio.wrap_future(future)),
        llm=SimpleNamespace(wake_up=lambda: calls.append("wake_up")),
    )
    asyncio.run(VLLMEngine.wake(engine))
    assert calls == ["empty_cache", "wake_up"] and not engine._sleeping
