"""Two-hop questions about a fictional world, answerable only by searching a bundled document collection.

The world is generated from a fixed seed: ``NUM_PEOPLE`` people with made-up, syllable-composed names,
each born in one of ``NUM_TOWNS`` made-up towns, each town lying in one of ``NUM_REGIONS`` made-up regions.
Every name is unique and shares no word with any other kind of entity, so no pretrained model knows the
facts, and a search for a name finds that entity's document. Each entity has one short document::

    {"id": "person-17", "title": "Vorlak Tessin", "text": "Vorlak Tessin was born in Maribo."}
    {"id": "town-3", "title": "Maribo", "text": "Maribo is a town in the region of Quenth."}

The question "In which region was Vorlak Tessin born?" needs two searches: the person's document names
the town, and only the town's document names the region. The collection is written to
``unipg/tools/data/multihop.jsonl``; ``python -m unipg.tasks.multihop`` regenerates it.

The ``multihop`` task's demonstrations are chat transcripts: a ``<tool_call>`` per hop, the exact text the
``search`` tool returns, and a final ``#### <region>`` line, the format the ``exact_match`` reward reads.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from pathlib import Path

from unipg.tasks.base import TASKS, Example, Task, _check_sizes, split_sizes
from unipg.tools.base import format_tool_call
from unipg.tools.retrieval import BUNDLED_DIR, STOPWORDS, search_tool

# The task's tools and turn limit: one search result per call (short tool output for small context
# windows), and room for two searches, the answer and one spare turn.
MULTIHOP_TOOLS = [{"name": "search", "options": {"collection": "multihop", "k": 1}}]
MULTIHOP_MAX_TURNS = 4
MULTIHOP_SYSTEM_PROMPT = (
    'Search with <tool_call>{"name": "search", "arguments": {"query": "..."}}</tool_call>. End with #### <answer>.'
)

WORLD_SEED = 20240917
NUM_PEOPLE, NUM_TOWNS, NUM_REGIONS = 400, 40, 8
COLLECTION_PATH = BUNDLED_DIR / "multihop.jsonl"

_ONSETS = "b d f g h k l m n p r s t v z br dr gr kr st th".split()
_VOWELS = "a e i o u".split()
_CODAS = ["", "", "", "n", "r", "l", "s", "k"]  # "" repeated: most syllables end in a vowel
_REGION_KINDS = ["coastal", "mountain", "river", "forest", "desert", "lake", "island", "valley"]
# Words of the document templates: a coined name equal to one of them would match every document.
_RESERVED = STOPWORDS | {"born", "town", "region", *_REGION_KINDS}


@dataclass(frozen=True)
class Person:
    """A person of the fictional world."""

    id: str  # document id, "person-<n>"
    name: str  # "First Last", unique
    town: str  # the town of birth


@dataclass(frozen=True)
class World:
    """The facts of the fictional world."""

    people: list[Person]
    town_region: dict[str, str]  # town -> the region it lies in, in generation order
    region_kind: dict[str, str]  # region -> a descriptive word such as "coastal"


def _coin_word(rng: random.Random, syllables: int, used: set[str]) -> str:
    """A new capitalised word of ``syllables`` consonant-vowel(-consonant) syllables, not yet in ``used``."""
    while True:
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
        if word not in used and word not in _RESERVED:
            used.add(word)
            return word.capitalize()


def generate_world(
    seed: int = WORLD_SEED, num_people: int = NUM_PEOPLE, num_towns: int = NUM_TOWNS, num_regions: int = NUM_REGIONS
) -> World:
    """The fictional world drawn from ``seed``; every region has towns and every name is unique.

    First names and surnames come from separate pools, so people may share either but never both, as in a
    real population; the pools are disjoint from town and region names.
    """
    if not 1 <= num_regions <= min(num_towns, len(_REGION_KINDS)) or num_people < 1:
        raise ValueError(
            f"need 1 <= num_regions <= min(num_towns, {len(_REGION_KINDS)}) and num_people >= 1; "
            f"got {num_people} people, {num_towns} towns, {num_regions} regions"
        )
    rng = random.Random(seed)
    used: set[str] = set()
    regions = [_coin_word(rng, 2, used) for _ in range(num_regions)]
    towns = [_coin_word(rng, 2, used) for _ in range(num_towns)]
    # town i lies in region i mod R, so regions hold equally many towns (± 1)
    town_region = {town: regions[i % num_regions] for i, town in enumerate(towns)}
    first_names = [_coin_word(rng, 2, used) for _ in range(max(2, num_people // 3))]
    surnames = [_coin_word(rng, 2, used) for _ in range(max(2, num_people // 2))]
    full_names: set[str] = set()
    people = []
    while len(people) < num_people:
        name = f"{rng.choice(first_names)} {rng.choice(surnames)}"
        if name not in full_names:
            full_names.add(name)
            people.append(Person(f"person-{len(people)}", name, rng.choice(towns)))
    region_kind = dict(zip(regions, rng.sample(_REGION_KINDS, num_regions)))
    return World(people, town_region, region_kind)


def world_documents(world: World) -> list[dict]:
    """One ``{"id", "title", "text"}`` record per region, town and person, in that order."""
    records = [
        {"id": f"region-{i}", "title": region, "text": f"{region} is a {kind} region."}
        for i, (region, kind) in enumerate(world.region_kind.items())
    ]
    records += [
        {"id": f"town-{i}", "title": town, "text": f"{town} is a town in the region of {region}."}
        for i, (town, region) in enumerate(world.town_region.items())
    ]
    records += [
        {"id": person.id, "title": person.name, "text": f"{person.name} was born in {person.town}."}
        for person in world.people
    ]
    return records


def collection_text(world: World | None = None) -> str:
    """The ``.jsonl`` text of the collection of ``world`` (the default world when None)."""
    records = world_documents(world or generate_world())
    return "".join(json.dumps(record) + "\n" for record in records)


def write_collection(path: str | Path = COLLECTION_PATH) -> Path:
    """Write the default world's collection to ``path`` (the bundled file by default) and return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(collection_text(), encoding="utf-8")
    return path


def demonstration(person: Person, region: str, search) -> list[dict]:
    """The assistant turns and tool results of a perfect two-hop answer, ending with ``#### <region>``."""
    messages = []
    for query in (person.name, person.town):
        messages.append({"role": "assistant", "content": format_tool_call("search", {"query": query})})
        messages.append({"role": "tool", "content": search(query)})
    messages.append({"role": "assistant", "content": f"#### {region}"})
    return messages


@TASKS.register("multihop")
def multihop_task(num_train: int | None = None, num_test: int = 80, data_seed: int = 1234) -> Task:
    """ "In which region was <person> born?" over the bundled fictional world; the answer is the region name.

    Each person is asked about once, so ``num_train + num_test`` is at most ``NUM_PEOPLE``; train and test
    hold different people. The test set is drawn first, so it does not change when ``num_train`` does;
    ``num_train`` None means every remaining person. Demonstrations search with ``MULTIHOP_TOOLS``.
    """
    _check_sizes("multihop", num_train=num_train, num_test=num_test)
    world = generate_world()
    num_train = split_sizes(
        "multihop: the bundled world (one question per person)",
        len(world.people),
        num_train=num_train,
        num_test=num_test,
        default_train=len(world.people),
        fix="lower num_test / num_train (each person is asked about once)",
    )
    rng = random.Random(data_seed)
    order = rng.sample(world.people, len(world.people))
    test_people, train_people = order[:num_test], order[num_test : num_test + num_train]
    search = search_tool(**MULTIHOP_TOOLS[0]["options"]).function

    def example(person: Person) -> Example:
        region = world.town_region[person.town]
        prompt = f"In which region was {person.name} born?"
        return Example(prompt, region, demonstration(person, region, search), {"answer": region})

    return Task(
        name="multihop",
        train=[example(person) for person in train_people],
        test=[example(person) for person in test_people],
        system_prompt=MULTIHOP_SYSTEM_PROMPT,
        rewards=[{"name": "exact_match", "weight": 1.0}],
        tools=copy.deepcopy(MULTIHOP_TOOLS),  # a copy: a caller editing task.tools leaves the constant alone
        max_turns=MULTIHOP_MAX_TURNS,
    )


if __name__ == "__main__":
    print(f"wrote {write_collection()}")
