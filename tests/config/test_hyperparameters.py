"""Estimator hyperparameters are checked at load time against what the estimator registries declare."""

from __future__ import annotations

from pathlib import Path

import pytest

from unipg.config import ConfigError, load_config
from unipg.config.hyperparameters import CHOICES, general_settings, governed
from unipg.config.schema import EstimatorConfig
from unipg.estimate import POLICY_LOSSES

ROOT = Path(__file__).resolve().parents[2]


def test_a_misspelled_hyperparameter_is_an_error_listing_the_accepted_names():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["estimator.clip_rnage=0.3"])
    message = str(error.value)
    assert "unknown key 'estimator.clip_rnage'; did you mean 'estimator.clip_range'?" in message
    accepted = ", ".join(POLICY_LOSSES.options("ppo"))
    assert f"policy loss 'ppo': {accepted}" in message and "advantage estimator 'gae': gamma, lambda_gae" in message


def test_a_misspelled_flat_key_lists_the_accepted_names_too():
    with pytest.raises(ConfigError, match=r"unknown key 'clip_rnage'; did you mean 'clip_range'\?.*policy loss 'ppo'"):
        load_config(None, ["clip_rnage=0.3"])


def test_the_list_follows_the_chosen_estimators():
    with pytest.raises(
        ConfigError,
        match=r"policy loss 'vanilla': loss_agg_mode;.*off-policy weight 'age_decay': "
        r"sample_age_decay",
    ):
        load_config(None, ["algorithm=a2c", "estimator.off_policy_weight=age_decay", "estimator.dual_clp=3"])


@pytest.mark.parametrize(
    "overrides, key, governing",
    [
        (["estimator.policy_loss=vanilla", "estimator.dual_clip=3"], "estimator.dual_clip", "estimator.policy_loss"),
        (["estimator.sample_age_decay=0.9"], "estimator.sample_age_decay", "estimator.off_policy_weight"),
        (["estimator.advantage=td", "estimator.lambda_gae=0.9"], "estimator.lambda_gae", "estimator.advantage"),
        (["estimator.max_kl=0.02"], "estimator.max_kl", "estimator.policy_loss"),
    ],
)
def test_a_hyperparameter_the_chosen_estimator_does_not_read_is_a_warning(overrides, key, governing):
    warnings = load_config(None, overrides).warnings
    assert any(w.startswith(f"'{key}' has no effect unless {governing} is") for w in warnings), warnings


def test_a_hyperparameter_the_chosen_estimator_reads_is_not_reported():
    config = load_config(
        None,
        [
            "estimator.policy_loss=decoupled_ppo",
            "estimator.dual_clip=3",
            "estimator.behaviour_weight_cap=5",
            "estimator.off_policy_weight=kl_filter",
            "estimator.kl_filter_threshold=0.2",
        ],
    )
    assert config.warnings == []
    assert load_config(None, ["algorithm=trpo", "estimator.max_kl=0.02"]).warnings == []


def test_seed_reference_loads_verbatim_and_reports_the_unread_age_decay():
    config = load_config(ROOT / "configs" / "seed_reference.yaml")
    assert config.estimator.sample_age_decay == 0.99 and config.estimator.off_policy_weight == "none"
    assert any(
        w.startswith("'estimator.sample_age_decay' has no effect unless estimator.off_policy_weight is age_decay")
        for w in config.warnings
    )


def test_every_estimator_field_is_a_selector_an_option_or_a_general_setting():
    fields = set(EstimatorConfig.model_fields)
    options = set(governed())
    selectors = {choice.selector for choice in CHOICES}
    assert options <= fields, "a registry declares an option that is not a field of section estimator"
    assert options | selectors | set(general_settings()) == fields
