"""Training runs whose episodes are played by agents of the usual frameworks (LangChain, litellm), unmodified:
they get the endpoint's base URL and an episode's key and use their framework's own tool calling. Both force a
tool call on their first turn (``tool_choice`` required), which the endpoint opens for the policy to complete."""

import json
from pathlib import Path

import pytest

from tests.helpers.configs import EXTERNAL_AGENT_RUN as RUN
from unipg.config import load_config
from unipg.inference import HFService, TurnOutput
from unipg.runtime.lm import train_lm

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
FORCED_OPENING = '"name": "'  # how the endpoint's opening of a required call ends (Hermes format)
CALL_COMPLETION = 'calculator", "arguments": {"expression": "2*3"}}</tool_call>'  # what the policy writes after it


@pytest.fixture
def completed_calls(monkeypatch):
    """The engine completes a forced call's opening with ``CALL_COMPLETION`` (the untrained embedded model would
    write no valid call) and samples every other turn itself; the list counts the completed calls."""
    completed, sample = [], HFService.generate

    async def generate(self, context_ids, **options):
        if not self.policy.decode(list(context_ids[-16:])).endswith(FORCED_OPENING):
            return await sample(self, context_ids, **options)
        completed.append(len(context_ids))
        tokens = self.policy.tokenizer(CALL_COMPLETION, add_special_tokens=False)["input_ids"]
        return TurnOutput(tokens, [-1.0] * len(tokens), CALL_COMPLETION, "stop", False, self.policy_version)

    monkeypatch.setattr(HFService, "generate", generate)
    return completed


@pytest.mark.parametrize("framework", ["langchain", "litellm"])
def test_a_framework_agent_trains_unmodified_with_its_tool_calls_recorded(
    framework, embedded_path, tmp_path, completed_calls, capfd
):
    agent = ROOT / "examples" / f"{framework}_agent" / "agent.py"
    overrides = [f"task.agent={agent}:run", "sample.max_new_tokens=24", "eval.every_updates=100", "log.episodes=true"]
    config = load_config(
        None,
        [*RUN, *overrides, f"model.name={embedded_path}", f"log.output_dir={tmp_path}", f"log.run_name={framework}"],
    )
    train_lm(config, log=lambda line: None)
    records = [json.loads(line) for line in (tmp_path / framework / "metrics.jsonl").read_text().splitlines()]
    rollouts = [record for record in records if "rollout/agent_failures" in record]
    assert len(rollouts) == 2 and all(record["rollout/agent_failures"] == 0 for record in rollouts)
    episodes = [json.loads(line) for line in (tmp_path / framework / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 16 and len(completed_calls) >= 16  # every episode opens with a required call (eval too)
    for episode in episodes:
        roles = [message["role"] for message in episode["messages"]]
        assert roles[:3] == ["user", "assistant", "tool"] and episode["messages"][2]["content"] == "6"
    assert "Traceback" not in capfd.readouterr().err
