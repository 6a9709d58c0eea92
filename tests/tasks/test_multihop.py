"""The multihop task: a fictional world whose questions need two correct searches of the bundled collection."""

from __future__ import annotations

import json
import re

import pytest

from unipg.tasks.base import make_task
from unipg.tasks.multihop import (
    COLLECTION_PATH,
    MULTIHOP_MAX_TURNS,
    MULTIHOP_TOOLS,
    NUM_PEOPLE,
    collection_text,
    generate_world,
    write_collection,
)
from unipg.tasks.rewards.rules import build_rewards
from unipg.tools.base import TOOLS
from unipg.tools.retrieval import load_documents, tokenize


@pytest.fixture(scope="module")
def task():
    return make_task("multihop")


def test_bundled_collection_is_what_the_generator_writes(tmp_path):
    regenerated = write_collection(tmp_path / "multihop.jsonl")
    assert regenerated.read_bytes() == COLLECTION_PATH.read_bytes()
    assert collection_text() == COLLECTION_PATH.read_text(encoding="utf-8")


def test_world_names_are_unique_ascii_and_never_shared_across_kinds():
    world = generate_world()
    names = [person.name for person in world.people]
    assert len(names) == len(set(names)) == NUM_PEOPLE
    person_words = {word for name in names for word in tokenize(name)}
    place_words = {word for place in [*world.town_region, *world.region_kind] for word in tokenize(place)}
    assert not person_words & place_words
    assert COLLECTION_PATH.read_text(encoding="utf-8").isascii()
    assert set(world.town_region.values()) == set(world.region_kind)  # every region holds towns


def test_splits_are_disjoint_people_and_reproducible(task):
    train_prompts = [example.prompt for example in task.train + task.validation]  # the validation split is carved
    test_prompts = [example.prompt for example in task.test]
    assert (len(train_prompts), len(task.test)) == (NUM_PEOPLE - 80, 80)
    assert len(set(train_prompts)) == len(train_prompts) and not set(train_prompts) & set(test_prompts)
    again = make_task("multihop")
    assert again.train == task.train and again.test == task.test
    assert make_task("multihop", data_seed=7).test != task.test
    assert make_task("multihop", num_train=10).test == task.test  # test people do not move with num_train
    with pytest.raises(ValueError, match="fewer than num_train"):
        make_task("multihop", num_train=NUM_PEOPLE, num_test=1)


def _parsed(example):
    """(queries the demonstration searches for, tool outputs, final assistant text)."""
    calls = [message["content"] for message in example.solution[:-1] if message["role"] == "assistant"]
    queries = [json.loads(re.fullmatch(r"<tool_call>(.*)</tool_call>", call).group(1)) for call in calls]
    outputs = [message["content"] for message in example.solution if message["role"] == "tool"]
    return queries, outputs, example.solution[-1]["content"]


def test_demonstrations_search_the_person_then_the_town_and_show_the_real_tool_output(task):
    world = generate_world()
    town_of = {person.name: person.town for person in world.people}
    search = TOOLS.get("search")(**MULTIHOP_TOOLS[0]["options"]).function
    for example in task.train + task.test:
        name = re.fullmatch(r"In which region was (.+) born\?", example.prompt).group(1)
        queries, outputs, final = _parsed(example)
        assert queries == [
            {"name": "search", "arguments": {"query": name}},
            {"name": "search", "arguments": {"query": town_of[name]}},
        ]
        assert outputs == [search(name), search(town_of[name])]
        # the first result of each search is the right document, so the demonstration is sound
        assert outputs[0] == f"[{name}] {name} was born in {town_of[name]}."
        assert outputs[1] == f"[{town_of[name]}] {town_of[name]} is a town in the region of {example.answer}."
        assert final == f"#### {example.answer}" and example.columns == {"answer": example.answer}


def test_the_answer_needs_the_second_hop(task):
    for example in task.train + task.test:
        _, outputs, _ = _parsed(example)
        assert example.answer.lower() not in tokenize(outputs[0])
        assert example.answer.lower() not in tokenize(example.prompt)
    person_texts = [d.text for d in load_documents(COLLECTION_PATH) if d.id.startswith("person-")]
    regions = set(generate_world().region_kind)
    assert not any(word.capitalize() in regions for text in person_texts for word in tokenize(text))


def test_demonstrations_fit_a_small_context(task):
    for example in task.train + task.test:
        _, outputs, _ = _parsed(example)
        assert max(len(output) for output in outputs) < 150
        assert sum(len(message["content"]) for message in example.solution) < 400


def test_task_declares_its_search_tool_and_turn_limit(task):
    assert task.tools == MULTIHOP_TOOLS and task.tools is not MULTIHOP_TOOLS
    assert task.max_turns == MULTIHOP_MAX_TURNS >= 3  # two searches and the answer
    assert all(sum(m["role"] == "assistant" for m in e.solution) <= task.max_turns for e in task.test)


def test_exact_match_rewards_the_demonstration_and_not_a_wrong_region(task):
    examples = task.test[:4]
    wrong = next(region for region in generate_world().region_kind if region != examples[0].answer)
    completions = [example.solution for example in examples] + [
        examples[0].solution[:-1] + [{"role": "assistant", "content": f"#### {wrong}"}]
    ]
    answers = [example.answer for example in examples] + [examples[0].answer]
    prompts = [example.prompt for example in examples] + [examples[0].prompt]
    result = build_rewards(task.rewards)(prompts, completions, answer=answers)
    assert result.total == [1.0, 1.0, 1.0, 1.0, 0.0]
