"""Evidence that a warm start has taught a tool task: greedy turns on held-out demonstrations.

A warm start for an agent task has to teach the skills RL then relies on: writing a call the environment
accepts, copying the problem's arguments into it, and reporting what the tool returned. All are measured on
held-out demonstrations that call a tool, greedily. They come from the task's validation split, never from its
test split: stopping a stage is a decision, and the test split only reports (``unipg.tasks.base``).

- ``call_validity``: the first turn is a call the environment would run (closing tag, JSON, a known tool,
  arguments that fit its schema: ``unipg.envs.tool_env.parse_turn``);
- ``argument_accuracy``: the call's arguments equal the demonstration's exactly; ``argument/<name>``: the share
  that copied that one argument (which of them the policy fails to copy);
- ``answer_accuracy``: with the demonstration's earlier turns (its calls and the tools' results) in the context,
  each trained turn after the first equals the demonstration's exactly: for a tool that computes the answer, the
  copy of its result.
  A demonstration of several turns without a call counts too: e.g. a solver's answer to a checker's critique,
  which carries the result it has to copy (``solver_checker``); a warm start whose demonstrations make no call
  is judged on this alone.

With ``sft.evidence_stop`` on, a stage of the warm start ends as soon as all pass their thresholds
(``sft.min_call_validity``, ``sft.min_argument_accuracy``, ``sft.min_answer_accuracy``), checked every
``sft.evidence_every`` steps; otherwise it runs to its ``steps``, which are then a cap. Learning to copy is abrupt
and its step varies with the data order and the machine (configs/calculator_agent.yaml), so a fixed step count
either wastes steps or stops too early; the evidence says when.
"""

from __future__ import annotations

from collections.abc import Callable

from unipg.config import Config
from unipg.envs.service import EnvironmentService
from unipg.envs.tool_env import parse_turn
from unipg.learn.sft_eval import greedy_completions
from unipg.sample.episodes import demonstration_pairs, tool_specs
from unipg.tasks.base import Example, Task


def first_call(example: Example) -> str | None:
    """The text of a demonstration's first assistant turn when that turn is a tool call, else None."""
    if isinstance(example.solution, str) or not example.solution or example.solution[0].get("role") != "assistant":
        return None
    content = example.solution[0].get("content", "")
    return content if "<tool_call>" in content else None


def call_evidence(model, tokenizer, task: Task, config: Config, examples: list[Example]) -> dict[str, float]:
    """``call_validity`` and ``argument_accuracy`` of the greedy first turns on the examples of ``examples``
    whose demonstration starts with a call (empty when none does, or the task has no tools)."""
    specs = tool_specs(config, task)
    examples = [example for example in examples if first_call(example) is not None]
    if not specs or not examples:
        return {}
    prompts = [prompt for prompt, _ in demonstration_pairs(tokenizer, task, config, examples)]
    turns = greedy_completions(model, tokenizer, prompts, max_new_tokens=config.sample.max_new_tokens)
    service = EnvironmentService.from_specs(specs)
    try:
        return call_scores(turns, [first_call(example) for example in examples], service)
    finally:
        service.close()


def goes_on(example: Example) -> bool:
    """Whether a demonstration has turns after its first: after a call, or after a message the policy answers."""
    return not isinstance(example.solution, str) and len(example.solution) > 1


def answer_turns(model, tokenizer, task: Task, config: Config, examples: list[Example]) -> list[tuple[str, str]]:
    """(greedy turn, demonstrated turn) for each trained turn after the first of each demonstration of
    ``examples``: the policy answers with the demonstration's earlier turns (its calls and the tools' results, or
    the messages it was sent) in the context, rendered as rollouts render them. Every such turn, not only the last:
    a checker that replies in two rounds is judged on both, and its first reply (to a wrong proposal, with the
    tool's result before it) is the one that shows whether it copies the result or the proposal."""
    prompts, answers = [], []
    for prompt, segments in demonstration_pairs(tokenizer, task, config, [e for e in examples if goes_on(e)]):
        for index, (text, trained) in enumerate(segments[1:], start=1):
            if trained:
                prompts.append(prompt + "".join(earlier for earlier, _ in segments[:index]))
                answers.append(text.removesuffix(tokenizer.eos_token or "").strip())
    if not prompts:
        return []
    turns = greedy_completions(model, tokenizer, prompts, max_new_tokens=config.sample.max_new_tokens)
    return list(zip(turns, answers))


def answer_evidence(model, tokenizer, task: Task, config: Config, examples: list[Example]) -> dict[str, float]:
    """``answer_accuracy`` of ``answer_turns`` (empty when the task has no tools or no demonstration goes on after
    its call)."""
    pairs = answer_turns(model, tokenizer, task, config, examples) if tool_specs(config, task) else []
    return {"answer_accuracy": sum(turn == answer for turn, answer in pairs) / len(pairs)} if pairs else {}


def call_scores(turns: list[str], demonstrated: list[str], service: EnvironmentService) -> dict[str, float]:
    """``call_validity`` and ``argument_accuracy`` of policy ``turns`` against the ``demonstrated`` calls."""
    parsed = [parse_turn(turn, service) for turn in turns]
    expected = [parse_turn(call, service) for call in demonstrated]
    valid = [turn.kind == "call" for turn in parsed]
    copied = [
        ok and (turn.name, turn.arguments) == (want.name, want.arguments)
        for ok, turn, want in zip(valid, parsed, expected)
    ]
    scores = {"call_validity": sum(valid) / len(valid), "argument_accuracy": sum(copied) / len(copied)}
    names = dict.fromkeys(name for want in expected for name in (want.arguments or {}))
    for name in names:  # which argument fails to be copied: the number, a unit word, ...
        scores[f"argument/{name}"] = sum(
            ok and (turn.arguments or {}).get(name) == (want.arguments or {}).get(name)
            for ok, turn, want in zip(valid, parsed, expected)
        ) / len(parsed)
    return scores


def evidence_examples(task: Task, count: int) -> list[Example]:
    """The demonstrations the evidence is measured on: the first ``count`` of ``task``'s validation split that start
    with a call or go on after their first turn (in a mixture of demonstrations, those that answer at once have
    nothing to measure). A ValueError when the split is empty, so that no stage runs to its cap while seeming to
    wait for evidence."""
    if not task.validation:
        raise ValueError(
            f"sft.evidence_stop measures the evidence on the validation split of task '{task.name}', which is empty; "
            "give it examples (eval.validation_examples, at least 1 with two training examples or more) or set "
            "sft.evidence_stop=off"
        )
    return [example for example in task.validation if first_call(example) is not None or goes_on(example)][:count]


def evidence_check(
    model, tokenizer, task: Task, config: Config, *, stage: str, log: Callable[[str], None]
) -> Callable[[int], bool]:
    """``check(step) -> stop``: measures ``call_evidence`` and ``answer_evidence`` on ``evidence_examples`` (the
    first ``sft.evidence_examples`` validation demonstrations of ``task`` that call a tool), logs them, records them
    in ``check.history``, and says whether every threshold passes (the answer's only where the demonstrations go on
    after the call)."""
    sft = config.sft
    examples = evidence_examples(task, sft.evidence_examples)

    def check(step: int) -> bool:
        evidence = call_evidence(model, tokenizer, task, config, examples)
        evidence |= answer_evidence(model, tokenizer, task, config, examples)
        if not evidence:
            return False
        check.history.append({"stage": stage, "step": step, **evidence})
        passed = (
            evidence.get("call_validity", 1.0) >= sft.min_call_validity
            and evidence.get("argument_accuracy", 1.0) >= sft.min_argument_accuracy
            and evidence.get("answer_accuracy", 1.0) >= sft.min_answer_accuracy
        )
        each = ", ".join(f"{key.split('/', 1)[1]} {value:.2f}" for key, value in evidence.items() if "/" in key)
        calls = (
            f"call validity {evidence['call_validity']:.2f}, argument accuracy {evidence['argument_accuracy']:.2f} "
            f"({each})"
            if "call_validity" in evidence
            else "no call"
        )
        answer = f", answer accuracy {evidence['answer_accuracy']:.2f}" if "answer_accuracy" in evidence else ""
        log(f"{stage}step {step} evidence: {calls}{answer}{' - passed, stage ends' if passed else ''}")
        return passed

    check.history = []
    return check
