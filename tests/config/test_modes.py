"""Which mode reads which key is declared on the field (``read_in``); the warnings about ignored keys follow it."""

import pytest
from pydantic import Field

from unipg.config import load_config
from unipg.config.modes import unread_keys
from unipg.config.section import Section, field_modes, read_in


def test_a_field_declares_the_modes_that_read_it_and_defaults_to_both():
    class Example(Section):
        both: int = 0
        """read in every run."""
        text: int = Field(0, json_schema_extra=read_in("lm"))
        """read in language-model runs."""

    assert field_modes(Example.model_fields["both"]) == ("gym", "lm")
    assert field_modes(Example.model_fields["text"]) == ("lm",)
    with pytest.raises(ValueError, match="unknown mode 'text'; modes are gym, lm"):
        read_in("text")


def test_unread_keys_name_whole_sections_and_single_fields():
    gym_unread, lm_unread = unread_keys("gym"), unread_keys("lm")
    assert {"task.*", "model.*", "sft.*", "agent.*", "rollback.*", "device", "train.batch_size"} <= gym_unread
    assert {"env.*", "policy.*", "train.batch_transitions", "train.critic_updates"} <= lm_unread
    assert "sample.rollout_steps" in gym_unread & lm_unread  # seed 000's key: no run reads it
    assert not {"train.learning_rate", "sample.replay_buffer_size", "checkpoint.*"} & (gym_unread | lm_unread)


def test_a_key_the_mode_never_reads_is_warned_about_and_a_shared_one_is_not():
    gym = load_config(None, ["algorithm=ppo", "model.name=gpt2", "device=cpu", "train.learning_rate=1e-3"])
    assert sorted(warning.split("'")[1] for warning in gym.warnings) == ["device", "model.name"]
    lm = load_config(
        None,
        [
            "algorithm=grpo",
            "task.name=arithmetic",
            "env.id=Pendulum-v1",
            "eval.episodes=5",
            "sample.replay_buffer_size=256",
            "train.batch_size=16",
            "train.mini_batch_size=16",
        ],
    )
    assert sorted(warning.split("'")[1] for warning in lm.warnings) == ["env.id", "eval.episodes"]
