"""Equal state bytes: every registered estimator gets exactly its largest configuration within a budget (one more
step is over it), group-sized estimators the smallest group that fits, and what cannot be sized says so."""

import numpy as np
import pytest
import torch

import kernapprox as ka
from kernapprox import memory

D, D_V, N = 16, 16, 128
GROUP_SIZED = {"eva", "eva_mean"}


def _bytes(name, n=N, **kwargs):
    """The estimator's own state_bytes on an independent draw (not the probe the sizing uses)."""
    x = torch.randn(n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    return ka.make_estimator(name, rng=1, **kwargs).fit(x, x).state_bytes(D_V, torch.float32, seq_len=n)


def _has_a_state(name):
    try:
        _bytes(name, num_features=None if ka.capabilities(name).fixed_dimension else 8)
    except ValueError:
        return False
    return True


SIZEABLE = [name for name in ka.available_estimators() if _has_a_state(name)]


def test_the_estimators_without_a_fixed_state_are_refused_by_name():
    refused = sorted(set(ka.available_estimators()) - set(SIZEABLE))
    assert {"kernel_svd", "attention_svd", "nystromformer"} <= set(refused) and "exact" not in refused  # KV cache
    budget = memory.budget_bytes(16, d=D, d_v=D_V, seq_len=N)
    for name in refused:
        with pytest.raises(ValueError):
            memory.sized_configuration(name, budget, d=D, d_v=D_V, seq_len=N)


@pytest.mark.parametrize("r", [8, 32])
@pytest.mark.parametrize("name", sorted(set(SIZEABLE) - GROUP_SIZED))
def test_every_feature_sized_estimator_gets_exactly_its_largest_configuration(name, r):
    budget = memory.budget_bytes(r, d=D, d_v=D_V, seq_len=N)
    config = memory.sized_configuration(name, budget, d=D, d_v=D_V, seq_len=N)
    caps = ka.capabilities(name)
    if caps.fixed_dimension:                                      # one configuration: fits or not
        assert (config is not None) == (_bytes(name, num_features=None) <= budget)
        assert config is None or config["num_features"] is None
        return
    step = memory.feature_step(name)
    if config is None:                                            # even the smallest configuration is over
        assert _bytes(name, num_features=step) > budget
        assert memory.smallest_state(name, d=D, d_v=D_V, seq_len=N) == _bytes(name, num_features=step)
        return
    used = config["num_features"]
    assert used % step == 0 and _bytes(name, num_features=used) <= budget
    if not (caps.rank_limited_by_points and used + step > N):    # the next valid size is over the budget
        assert _bytes(name, num_features=used + step) > budget
    if name in memory.BUDGET_BASELINES:                           # the baselines define the budget at r itself
        assert used == r


@pytest.mark.parametrize("name", sorted(GROUP_SIZED))
def test_group_sized_estimators_get_the_most_groups_that_fit(name):
    budget = memory.budget_bytes(256, d=D, d_v=D_V, seq_len=N)       # above EVA's exact window of 32 tokens
    config = memory.sized_configuration(name, budget, d=D, d_v=D_V, seq_len=N, size_by="group_size")
    g = config["group_size"]
    assert 1 < g < N
    assert config["num_features"] == -(-N // g)
    assert _bytes(name, num_features=config["num_features"], group_size=g) <= budget
    for smaller in range(1, g):                                   # every finer grouping is over the budget
        assert _bytes(name, num_features=-(-N // smaller), group_size=smaller) > budget
    tight = memory.budget_bytes(1, d=D, d_v=D_V, seq_len=N)
    assert memory.sized_configuration(name, tight, d=D, d_v=D_V, seq_len=N, size_by="group_size") is None
    smallest = memory.smallest_state(name, d=D, d_v=D_V, seq_len=N, size_by="group_size")
    assert smallest > tight
    assert smallest == min(_bytes(name, num_features=-(-N // g), group_size=g) for g in range(1, N + 1))


def test_the_budget_is_the_larger_baseline_state_and_options_are_kept():
    budget = memory.budget_bytes(32, d=D, d_v=D_V, seq_len=N)
    assert budget == max(_bytes(name, num_features=32) for name in memory.BUDGET_BASELINES)
    assert budget >= 32 * (D_V + 1) * 4
    config = memory.sized_configuration("eva", budget * 4, d=D, d_v=D_V, seq_len=N, options={"window": 0},
                                        size_by="group_size")
    assert config["window"] == 0
    assert memory.sized_configuration("trig", budget, d=D, d_v=D_V, seq_len=N)["num_features"] % 2 == 0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="size_by"):
        memory.sized_configuration("trig", 1000, d=D, d_v=D_V, seq_len=N, size_by="rank")
    with pytest.raises((ValueError, TypeError), match="budget"):
        memory.sized_configuration("trig", 0, d=D, d_v=D_V, seq_len=N)
    with pytest.raises((ValueError, TypeError), match="seq_len"):
        memory.probe_state_bytes("trig", 8, d=D, d_v=D_V, seq_len=0)
    assert np.isfinite(memory.probe_state_bytes("trig", 8, d=D, d_v=D_V, seq_len=N))
