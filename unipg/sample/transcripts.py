"""Transcripts: what happened in an episode, turn by turn, as plain data and as text a person reads.

A transcript is a JSON-ready dict::

    {"prompt": "What is 347*862?", "reference": "299114", "reward": 1.1, "correct": true, "finish": "done",
     "turns": [{"text": "<tool_call>...</tool_call>", "call": {"name": "calculator",
                "arguments": {"expression": "347*862"}}, "status": "ok", "result": "299114"},
               {"text": "299114"}],
     "answer": "299114"}

An external agent that rewrote its history mid-episode left further trajectories beside the main one; they are
listed under ``"side"``, each a transcript of the same form.

``call`` is present on a turn that called a tool (``arguments`` only when the call was well formed), with the
call's ``status`` (ok, error, malformed, failed) and the ``result`` the agent was shown; ``answer`` is the text
of the final turn when the episode ended with an answer, None otherwise (cut short by its turn or token budget).
"""

from __future__ import annotations

import json

from unipg.sample.agent import Trajectory


def transcript(trajectory: Trajectory) -> dict:
    """The transcript of one episode (see the module docstring)."""
    turns = []
    for text, info in zip(trajectory.turn_texts, trajectory.infos):
        turn: dict = {"text": text}
        if info.tool_status is not None:
            call = {"name": info.tool}
            if info.arguments is not None:
                call["arguments"] = info.arguments
            turn.update({"call": call, "status": info.tool_status, "result": info.observation})
        turns.append(turn)
    final = trajectory.infos[-1].final if trajectory.infos else False
    record = {
        "prompt": trajectory.example.prompt,
        "reference": trajectory.example.answer,
        "turns": turns,
        "answer": trajectory.turn_texts[-1] if final else None,
        "reward": trajectory.reward,
        "correct": trajectory.correct,
        "finish": trajectory.finish,
    }
    if trajectory.side:  # an external agent's rewritten history, trained beside the main trajectory
        record["side"] = [transcript(side) for side in trajectory.side]
    return record


def format_transcript(record: dict) -> str:
    """Plain text of a transcript, one line per event.

    >>> print(format_transcript({"prompt": "What is 2*3?", "reference": "6", "reward": 1.0, "correct": True,
    ...     "finish": "done", "answer": "6", "turns": [
    ...     {"text": "...", "call": {"name": "calculator", "arguments": {"expression": "2*3"}}, "status": "ok",
    ...      "result": "6"}, {"text": "6"}]}))
    prompt:    What is 2*3?
    call:      calculator(expression="2*3")
    result:    6  [ok]
    answer:    6
    reward:    1  (correct; reference 6)
    """
    lines = [f"prompt:    {record['prompt']}"]
    for turn in record["turns"]:
        call = turn.get("call")
        if call is None:
            continue
        if "arguments" in call:
            lines.append(f"call:      {call['name']}({format_arguments(call['arguments'])})")
        else:
            lines.append(f"call:      {turn['text'].strip()}")
        lines.append(f"result:    {turn.get('result')}  [{turn.get('status')}]")
    if record.get("answer") is not None:
        lines.append(f"answer:    {record['answer'].strip()}")
    else:
        lines.append(f"answer:    none (episode ended: {record.get('finish')})")
    verdict = "correct" if record.get("correct") else "wrong"
    lines.append(f"reward:    {record['reward']:.4g}  ({verdict}; reference {record['reference']})")
    for index, side in enumerate(record.get("side", ()), 1):
        lines.append(f"side {index}:    a history the agent rewrote, trained beside this one")
        lines += ["  " + line for line in format_transcript(side).splitlines()]
    return "\n".join(lines)


def format_arguments(arguments: dict) -> str:
    """``name=value`` pairs of a call, strings quoted: ``value=3, from_unit="km"``."""
    return ", ".join(f"{name}={json.dumps(value)}" for name, value in arguments.items())
