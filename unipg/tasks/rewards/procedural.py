"""The reward of the ``reasoning_gym`` task: each generator's own ``score_answer``."""

from __future__ import annotations

from unipg.tasks.rewards.rules import REWARDS, RewardFunction, text_of


@REWARDS.register("reasoning_gym")
def reasoning_gym_reward() -> RewardFunction:
    """The score the generator of each example's ``entry`` column gives the completion's answer, in [0, 1]: the
    text between ``<answer>`` tags when there are some, else the whole completion, stripped."""
    from reasoning_gym.factory import get_score_answer_fn
    from reasoning_gym.utils import extract_answer

    def reasoning_gym_score(prompts: list, completions: list, entry: list, **columns) -> list[float | None]:
        scores = []
        for completion, problem in zip(completions, entry):
            text = text_of(completion, "assistant")
            answer = extract_answer(text) or text.strip()
            score = get_score_answer_fn(problem["metadata"]["source_dataset"])
            scores.append(float(score(answer, problem)))
        return scores

    return reasoning_gym_score
