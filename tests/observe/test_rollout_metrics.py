"""One predicate says whether a group can teach anything: the logged uniform-group fraction and dynamic sampling's
test agree, also where a float mean is inexact and in multi-role groups."""

from types import SimpleNamespace

from unipg.observe.rollout_metrics import group_signal_metrics, uniform_groups
from unipg.runtime.lm_run import mixed_returns
from unipg.runtime.replay import Group


def group(returns: list[float], size: int) -> Group:
    return Group([SimpleNamespace(reward=value) for value in returns], 0, size)


def test_equal_returns_are_uniform_even_where_their_float_mean_is_inexact():
    returns = [0.1] * 8  # a float32 std of eight 0.1s is not exactly 0
    assert uniform_groups(returns, 8) == [True] and not mixed_returns(group(returns, 8))
    assert group_signal_metrics(returns, [False] * 8, 8)["rollout/uniform_group_fraction"] == 1.0


def test_a_multi_role_group_is_compared_role_by_role():
    alike_per_role = [1.0, 1.0, 0.5, 0.5]  # two episodes, role after role: each role scored alike
    assert uniform_groups(alike_per_role, 2) == [True, True] and not mixed_returns(group(alike_per_role, 2))
    one_role_differs = [1.0, 1.0, 0.0, 0.5]
    assert uniform_groups(one_role_differs, 2) == [True, False] and mixed_returns(group(one_role_differs, 2))


def test_the_fraction_and_the_filter_count_the_same_groups():
    returns = [0.0, 0.0, 1.1, 0.1, 0.3, 0.3, 1.0, 1.0]
    kept = [mixed_returns(group(returns[i : i + 2], 2)) for i in range(0, 8, 2)]
    fraction = group_signal_metrics(returns, [False] * 8, 2)["rollout/uniform_group_fraction"]
    assert kept == [False, True, False, False] and fraction == 1 - sum(kept) / len(kept)
