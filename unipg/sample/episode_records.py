"""Episodes as JSON records: what ``log.episodes`` writes and what ``data.offline`` reads back.

One JSON object per line, one line per episode and role::

    {"prompt": "What is 347*862?",          # the task prompt: with "role", what offline groups are keyed on
     "answer": "299114", "role": null,       # the reference answer; the role (multi-role episodes) or null
     "messages": [{"role": "user", "content": "What is 347*862?"},
                  {"role": "assistant", "content": "<tool_call>...</tool_call>"},
                  {"role": "tool", "content": "299114"},
                  {"role": "assistant", "content": "299114"}],
     "reward": 1.1, "step_rewards": [0.1, 1.0], "correct": true, "finish": "done", "update": 3,
     "prompt_ids": [...], "token_ids": [...], "loss_mask": [...],     # optional: the exact tokens
     "behaviour_logprobs": [...], "turn_of_token": [...], "policy_versions": [0, 0]}   # optional

``version_changes`` ([[token index, version], ...]) is written for an episode a weight load interrupted inside a
turn (``runtime.partial_rollouts``); like ``policy_versions``, it is not read back (versions count another run's
updates).

An episode of an external agent that rewrote its history has further trajectories beside the main one
(``Trajectory.side``); its record lists them under ``"side"``, each a record of the same form. Offline data reads
them back as such, so each is trained as a row beside its main trajectory, as it was when it was sampled.

Only ``messages`` (a first observation, then at least one assistant turn) and ``reward`` or ``step_rewards``
are required. A record with token ids is used token for token; one without is laid out as rollouts lay out
turns (``TurnTemplate.demonstration``), its first observation rendered with the run's system prompt and tools.
Behaviour log-probs are used when given (they need the token ids); otherwise the reader leaves them empty and
the caller supplies them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

from unipg.config import ConfigError
from unipg.envs.base import TurnInfo
from unipg.policy.chat import TurnTemplate
from unipg.sample.agent import Trajectory
from unipg.tasks.base import Example

TOKEN_FIELDS = ("prompt_ids", "token_ids", "loss_mask")


def episode_record(trajectory: Trajectory, *, update: int) -> dict:
    """The JSON record of ``trajectory``, trained at learner update ``update``."""
    messages = list(trajectory.messages[:1]) or [{"role": "user", "content": trajectory.example.prompt}]
    for turn, text in enumerate(trajectory.turn_texts):
        messages.append({"role": "assistant", "content": text})
        messages += trajectory.messages[turn + 1 : turn + 2]
    record = {
        "prompt": trajectory.example.prompt,
        "answer": trajectory.example.answer,
        "role": trajectory.role,
        "messages": messages,
        "reward": trajectory.reward,
        "step_rewards": list(trajectory.step_rewards),
        "correct": trajectory.correct,
        "finish": trajectory.finish,
        "update": update,
        "prompt_ids": list(trajectory.prompt_ids),
        "token_ids": list(trajectory.token_ids),
        "loss_mask": list(trajectory.loss_mask),
        "behaviour_logprobs": list(trajectory.behaviour_logprobs),
        "turn_of_token": list(trajectory.turn_of_token),
        "policy_versions": list(trajectory.policy_versions),
    }
    if trajectory.version_changes:  # turns a weight load interrupted (runtime.partial_rollouts)
        record["version_changes"] = [list(change) for change in trajectory.version_changes]
    if trajectory.side:  # the trajectories an external agent's rewritten history left beside this one
        record["side"] = [episode_record(side, update=update) for side in trajectory.side]
    return record


def read_episode_records(path: str | Path) -> list[dict]:
    """The records of a JSONL file of episodes, each checked (``check_record``); blank lines are skipped."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"data.offline.path '{path}' is not a file; point it at a .jsonl of episodes, such as the "
            "episodes.jsonl a run with log.episodes=true writes"
        )
    records = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as error:
                raise ConfigError(f"{path}, line {number}: not valid JSON ({error})") from None
            problem = check_record(record)
            if problem:
                raise ConfigError(f"{path}, line {number}: {problem}")
            records.append(record)
    if not records:
        raise ConfigError(f"data.offline.path '{path}' holds no episodes; write one JSON object per line")
    return records


def check_record(record) -> str | None:
    """What is wrong with an episode record, or None."""
    if not isinstance(record, dict):
        return "an episode must be a JSON object"
    messages = record.get("messages")
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str) for m in messages
    ):
        return '\'messages\' must be a list of {"role": ..., "content": "..."} objects'
    messages = [m for m in messages if m["role"] != "system"]
    if not messages or messages[0]["role"] == "assistant" or len(assistant_turns(messages)) == 0:
        return "'messages' must start with the first observation (a user message) and hold an assistant turn"
    rewards = record.get("step_rewards", [record.get("reward")])
    if (
        not isinstance(rewards, list)
        or not rewards
        or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) for r in rewards)
    ):
        return "give the episode's 'reward' (a finite number) or its 'step_rewards' (a list of them)"
    present = [name for name in TOKEN_FIELDS if name in record]
    if present and len(present) < len(TOKEN_FIELDS):
        return f"token ids need all of {', '.join(TOKEN_FIELDS)}; the record has only {', '.join(present)}"
    if present:
        if len(record["loss_mask"]) != len(record["token_ids"]):
            return "'loss_mask' must have one entry per token of 'token_ids'"
        if "behaviour_logprobs" in record and len(record["behaviour_logprobs"]) != len(record["token_ids"]):
            return "'behaviour_logprobs' must have one entry per token of 'token_ids' (0 on inserted tokens)"
    elif "behaviour_logprobs" in record:
        return "'behaviour_logprobs' are only usable with the token ids they belong to (prompt_ids, token_ids, ...)"
    side = record.get("side", [])
    if not isinstance(side, list):
        return "'side' must be a list of episode records (the trajectories trained beside the main one)"
    for number, other in enumerate(side, 1):
        problem = (
            "a side trajectory has no 'side' of its own"
            if isinstance(other, dict) and "side" in other
            else check_record(other)
        )
        if problem:
            return f"side trajectory {number}: {problem}"
    return None


def assistant_turns(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "assistant"]


def trajectory_from_record(
    record: dict, *, encode: Callable[[str], list[int]], template: TurnTemplate, vocab_size: int
) -> Trajectory:
    """The trajectory of a checked record (``check_record``), marked ``offline``, sampled by version −1 (one
    version before this run's first weights; a record's own versions count another run's updates). ``encode``
    renders and tokenises a first observation as rollouts do."""
    messages = [m for m in record["messages"] if m["role"] != "system"]
    turns = assistant_turns(messages)
    first = messages[0]["content"]
    example = Example(str(record.get("prompt", first)), str(record.get("answer", "")), "", {})
    trajectory = Trajectory(
        example,
        [],
        messages=[messages[0]] + [m for m in messages[1:] if m["role"] != "assistant"],
        role=record.get("role"),
        offline=True,
        turn_texts=turns,
        finish=record.get("finish", "done"),
    )
    if "token_ids" in record:
        trajectory.prompt_ids, trajectory.token_ids = list(record["prompt_ids"]), list(record["token_ids"])
        trajectory.loss_mask = [int(bool(m)) for m in record["loss_mask"]]
        trajectory.behaviour_logprobs = [float(v) for v in record.get("behaviour_logprobs", [])]
        trajectory.turn_of_token = list(record.get("turn_of_token") or turn_of_tokens(trajectory.loss_mask))
        if any(not 0 <= token < vocab_size for token in trajectory.prompt_ids + trajectory.token_ids):
            raise ConfigError(
                f"episode of prompt {example.prompt!r}: token ids outside the model's vocabulary "
                f"(0 … {vocab_size - 1}); it was recorded with another tokenizer: drop its token "
                "fields so that its messages are tokenised again"
            )
    else:
        trajectory.prompt_ids = encode(first)
        tokenize = lambda text: template.tokenizer(text, add_special_tokens=False)["input_ids"]
        turn = -1
        for text, trained in template.demonstration(messages[1:]):
            ids = tokenize(text)
            if trained:
                turn += 1
                trajectory.add_sampled(ids, [], turn)
            else:
                trajectory.add_inserted(ids)
        trajectory.behaviour_logprobs = []  # none recorded: the caller computes them
    turn_count = max(max(trajectory.turn_of_token, default=-1) + 1, 1)
    trajectory.turn_texts = (turns + [""] * turn_count)[:turn_count]
    rewards = record.get("step_rewards") or [record["reward"]]
    if len(rewards) != turn_count:  # the episode's return on its last turn
        rewards = [0.0] * (turn_count - 1) + [float(sum(rewards))]
    trajectory.step_rewards = [float(r) for r in rewards]
    trajectory.policy_versions = [-1] * turn_count  # recorded versions belong to another run's count
    trajectory.infos = [TurnInfo() for _ in range(turn_count - 1)] + [TurnInfo(correct=bool(record.get("correct")))]
    trajectory.side = [
        trajectory_from_record(side, encode=encode, template=template, vocab_size=vocab_size)
        for side in record.get("side", ())
    ]
    return trajectory


def turn_of_tokens(loss_mask: list[int]) -> list[int]:
    """The policy turn of each token from a loss mask: each run of sampled tokens is one turn, −1 elsewhere."""
    turns, turn, previous = [], -1, 0
    for sampled in loss_mask:
        if sampled and not previous:
            turn += 1
        turns.append(turn if sampled else -1)
        previous = sampled
    return turns
