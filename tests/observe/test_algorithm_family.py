"""The family table: every preset and registered estimator placed on the axes of J = E_μ[ρ · A · w], and
docs/algorithms.md generated from it."""

from pathlib import Path

from unipg.config.hyperparameters import CHOICES
from unipg.estimate import ADVANTAGES
from unipg.estimate.families import ADVANTAGE_BASELINES, LOSS_AXES
from unipg.observe.report import algorithm_axes, algorithms_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_every_registered_policy_loss_and_advantage_has_its_axes():
    policy_losses = next(choice for choice in CHOICES if choice.selector == "policy_loss")
    assert set(policy_losses.names()) == set(LOSS_AXES)
    assert set(ADVANTAGES.names()) == set(ADVANTAGE_BASELINES)


def test_preset_axes_name_the_ratio_level_weight_and_kl_placement():
    rows = {(row["name"], row["setting"]): row for row in algorithm_axes()}
    assert rows["gspo", "text"]["ratio"].startswith("sequence") and rows["gspo", "text"]["KL"] == "none"
    assert rows["cispo", "text"]["weight"] == "clipped weight, gradient stopped"
    assert rows["grpo", "text"]["KL"] == "loss term k3, β 0.04"
    assert rows["rloo", "text"]["KL"] == "in reward k1, β 0.05"
    assert rows["ppo", "text"]["KL"] == "in reward k1, β 0.05" and rows["ppo", "gym"]["KL"] == "none"
    assert rows["sapo", "text"]["aggregation"] == "seq-mean-token-mean"


def test_docs_algorithms_md_is_generated_from_the_registries():
    committed = (ROOT / "docs" / "algorithms.md").read_text(encoding="utf-8")
    assert committed == algorithms_markdown(), "regenerate: python -m unipg.observe.report > docs/algorithms.md"
