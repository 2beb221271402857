"""Equal state bytes in the studies: the budget is the state of FAVOR+/OPRF at r features, every other estimator
gets its largest configuration within it (checked against the estimators' own state_bytes), estimators that fit
no budget or are not defined causally are not applicable (NaN with the reason recorded), and the LARA/EVA tables
build estimators the read-outs accept."""

import numpy as np
import pytest
import torch

import kernapprox as ka
from experiments import _common, _icl, attention_error
from kernapprox import memory
from kernapprox.sweep._worker import normalise_metrics

D = D_V = 32


def _bytes(name, n, **kwargs):
    q = torch.randn(n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return ka.make_estimator(name, rng=0, **kwargs).fit(q, q).state_bytes(D_V, torch.float32, seq_len=n)


def test_the_budget_is_the_larger_state_of_favor_plus_and_oprf():
    for r in (16, 64):
        budget = memory.budget_bytes(r, d=D, d_v=D_V, seq_len=256)
        assert budget == max(_bytes("positive_orthogonal", 256, num_features=r),
                             _bytes("oprf_orthogonal", 256, num_features=r))
        assert budget >= r * (D_V + 1) * 4
        for name in memory.BUDGET_BASELINES:        # both baselines run at r itself
            assert _common.sized_configuration(name, {}, budget, d=D, d_v=D_V, seq_len=256)["num_features"] == r


@pytest.mark.parametrize("name", ["lara", "lara_balance", "nystrom_uniform", "window_linear", "scatterbrain"])
def test_feature_sized_estimators_get_their_largest_configuration_within_the_budget(name):
    n, budget = 512, memory.budget_bytes(256, d=D, d_v=D_V, seq_len=512)
    config = _common.sized_configuration(name, {}, budget, d=D, d_v=D_V, seq_len=n)
    r = config["num_features"]
    step = 2 if name == "scatterbrain" else 1                          # hyperbolic features come in pairs
    assert _bytes(name, n, num_features=r) <= budget < _bytes(name, n, num_features=r + step)


@pytest.mark.parametrize("window", [32, 0])
def test_eva_gets_the_most_groups_whose_state_fits(window):
    n, budget = 512, memory.budget_bytes(256, d=D, d_v=D_V, seq_len=512)
    config = _common.sized_configuration("eva", {"window": window}, budget, d=D, d_v=D_V, seq_len=n)
    g = config["group_size"]
    assert config["num_features"] == -(-n // g) and config["window"] == window
    assert _bytes("eva", n, num_features=config["num_features"], group_size=g, window=window) <= budget
    for smaller in range(1, g):                                        # every finer grouping is over the budget
        assert _bytes("eva", n, num_features=-(-n // smaller), group_size=smaller, window=window) > budget


def test_nothing_fits_is_none_and_the_smallest_state_says_why():
    n = 2048
    budget = memory.budget_bytes(64, d=D, d_v=D_V, seq_len=n)
    assert _common.sized_configuration("eva", {}, budget, d=D, d_v=D_V, seq_len=n) is None
    assert _common.sized_configuration("window_linear", {}, budget, d=D, d_v=D_V, seq_len=n) is None
    smallest = _common.smallest_state("eva", {}, d=D, d_v=D_V, seq_len=n)
    assert smallest > budget
    assert smallest == min(_bytes("eva", n, num_features=-(-n // g), group_size=g) for g in range(1, 200))


def _cell(**overrides):
    exp = attention_error.EXPERIMENT
    params = {**exp.parameter_values(), "estimator": "lara", "num_features": 256, "seq_len": 64, "causal": False,
              "beta": 2.0, "seed": 0, **overrides}
    device = torch.device("cpu")
    data = attention_error.draw(params, np.random.default_rng(1), device)
    out = attention_error.run_cell(params, np.random.default_rng(0), device, data)
    return normalise_metrics(exp, out)                   # as the engine stores it (not applicable: NaN)


def test_attention_error_cells_record_their_configuration_within_the_budget():
    out = _cell()
    assert out["state_bytes"] <= out["budget_bytes"] and out["features_used"] == 83 and np.isnan(out["group_size"])
    assert np.isfinite(out["output_rel_rms"]) and out["nonpositive_rate"] == 0.0
    eva = _cell(estimator="eva_mean", causal=True)
    assert eva["state_bytes"] <= eva["budget_bytes"] and eva["group_size"] >= 1
    assert eva["features_used"] == -(-64 // eva["group_size"])


def test_attention_error_not_applicable_cells_are_nan_with_the_reason_recorded():
    causal = _cell(causal=True)                                         # LARA is defined non-causally
    assert np.isnan(causal["output_rel_rms"]) and np.isnan(causal["state_bytes"])
    assert causal["budget_bytes"] > 0 and causal["smallest_state_bytes"] > 0
    small = _cell(estimator="window_linear", num_features=16)          # its window alone exceeds the budget
    assert np.isnan(small["output_rel_rms"]) and small["smallest_state_bytes"] > small["budget_bytes"]
    outside = _cell(estimator="positive_orthogonal", beta=1.0, seq_len=4096)   # beyond beta_sweep_max_len
    assert all(np.isnan(v) for v in outside.values())


def test_icl_sized_readouts_stay_below_the_kv_cache_and_within_the_budget():
    n, d = 64, 64
    kv = _icl.kv_cache_bytes(n, d, d)
    for label in _icl.SET_CONTEXT_EQUAL_BYTES:
        sized = _icl.sized_readout(_icl.SET_CONTEXT_EQUAL_BYTES, label, 64, num_context=n, d=d, d_v=d)
        name, config, budget = sized
        assert budget < kv and name in _icl.BATCH_READOUTS
        if name.startswith("eva"):
            assert config["window"] == 0
        assert _icl.sized_readout(_icl.SET_CONTEXT_EQUAL_BYTES, label, 4096, num_context=n, d=d, d_v=d) is None


def _studies_feature_sized():
    """Every registry name the studies size by features (random maps, Nyström, LARA, hybrids)."""
    from experiments import query_distribution
    names = {n for n in query_distribution.ESTIMATORS if n not in query_distribution.ORACLES}
    names |= {spec[0] for spec in attention_error.SIZED.values()} | set(attention_error.RANDOM_FEATURES)
    names |= {spec[0] for spec in _icl.SET_CONTEXT_EQUAL_BYTES.values()}
    return sorted(n for n in names if n not in _common.GROUP_SIZED)


RANDOM_MAPS = {"trig", "trig_orthogonal", "positive", "positive_orthogonal", "hyperbolic_orthogonal", "oprf",
               "oprf_orthogonal"}


@pytest.mark.parametrize("name", _studies_feature_sized())
def test_every_feature_sized_estimator_of_the_studies_follows_the_rule(name):
    """The largest configuration within B(r): within the budget, one more step is over it (or over n landmarks);
    the random-feature maps run at r itself; an estimator that fits nothing has a smallest state over B(r)."""
    n, r = 256, 64
    budget = memory.budget_bytes(r, d=D, d_v=D_V, seq_len=n)
    config = _common.sized_configuration(name, {}, budget, d=D, d_v=D_V, seq_len=n)
    if config is None:                                  # nothing fits: even its smallest state is over the budget
        assert _common.smallest_state(name, {}, d=D, d_v=D_V, seq_len=n) > budget and name not in RANDOM_MAPS
        return
    used, step = config["num_features"], memory.feature_step(name)
    assert _bytes(name, n, num_features=used) <= budget
    if not (ka.capabilities(name).rank_limited_by_points and used + step > n):
        assert _bytes(name, n, num_features=used + step) > budget
    if name in RANDOM_MAPS:
        assert used == r


@pytest.mark.parametrize("name", ["eva", "eva_mean"])
def test_both_eva_variants_are_sized_by_groups_within_the_budget(name):
    n, budget = 512, memory.budget_bytes(256, d=D, d_v=D_V, seq_len=512)
    config = _common.sized_configuration(name, {}, budget, d=D, d_v=D_V, seq_len=n)
    g = config["group_size"]
    assert _bytes(name, n, num_features=config["num_features"], group_size=g) <= budget
    assert g == 1 or _bytes(name, n, num_features=-(-n // (g - 1)), group_size=g - 1) > budget


@pytest.mark.parametrize("r", [64, 256])
def test_icl_recall_budgets_at_n_256_fit_every_lara_eva_row(r):
    """At the recall study's n = 256 pairs and d = 64 both matched budgets are below the KV cache and every
    LARA/EVA row gets a configuration within them, checked against the estimator's own state_bytes."""
    from experiments import icl_recall
    n, d = 256, int(icl_recall.EXPERIMENT.parameter_values()["dim"])
    for label in icl_recall.SIZED:
        name, config, budget = _icl.sized_readout(icl_recall.ESTIMATORS, label, r, num_context=n, d=d, d_v=d)
        x = torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        est = ka.make_estimator(name, rng=0, **config).fit(x, x)
        assert est.state_bytes(d, torch.float32, seq_len=n) <= budget < _icl.kv_cache_bytes(n, d, d)
