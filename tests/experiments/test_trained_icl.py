"""trained_icl's proxy-validity statistics on constructed datasets whose answers are known: the partial rank
correlation controlling for log₂ r, the within-r pair verdicts and the calibration gap."""

import numpy as np
import pytest
import xarray as xr

from experiments import _trained_icl_report as report
from experiments import trained_icl

RANKS = [16, 32, 64, 128, 256]


def _dataset(post: dict, proxy: dict, seeds: int = 12, episodes: int = 4, fixed: dict | None = None) -> xr.Dataset:
    """A one-task, one-context dataset in trained_icl's layout: ``post[est]``, ``proxy[est]`` are arrays
    ``(r, seed, episode)`` over RANKS; ``fixed[est]`` = realised dimension of a fixed map (values only at r = 64)."""
    fixed = fixed or {}
    ests = ["exact", *post]
    shape = (1, 1, len(ests), len(RANKS), 1, seeds, episodes)
    score, prox = np.full(shape, np.nan), np.full(shape, np.nan)
    dim = np.full(shape[:-1], np.nan)
    ranks = np.asarray(RANKS, dtype=float)[:, None]
    for e, est in enumerate(ests[1:], start=1):
        score[0, 0, e, :, 0], prox[0, 0, e, :, 0] = post[est], proxy[est]
        realised = np.where(ranks == 64, fixed[est], np.nan) if est in fixed else ranks
        dim[0, 0, e, :, 0] = realised * np.ones((1, seeds))
    coords = {"task": ["mqar"], "substitution": ["all"], "estimator": ests, "num_features": RANKS, "context": [8],
              "seed": np.arange(seeds), "episode": np.arange(episodes)}
    dims = tuple(coords)
    return xr.Dataset({"score": (dims, score), "proxy_accuracy": (dims, prox), "feature_dim": (dims[:-1], dim)},
                      coords=coords)


def _grid(fn, seeds=12, episodes=4, rng=None):
    """``fn(r)`` broadcast to ``(r, seed, episode)``, plus optional per-entry noise from ``rng``."""
    base = np.array([fn(r) for r in RANKS], dtype=float)[:, None, None] * np.ones((1, seeds, episodes))
    return base if rng is None else base + 0.01 * rng.normal(size=base.shape)


def test_a_proxy_that_only_reads_r_has_no_partial_correlation():
    """proxy = f(r) for every estimator: its ranks are those of log₂ r, so nothing is left once r is controlled
    for (undefined, NaN), while the plain ρ is high because the post-hoc accuracy also grows with r."""
    rng = np.random.default_rng(0)
    post = {"a": _grid(lambda r: np.log2(r) / 10, rng=rng), "b": _grid(lambda r: np.log2(r) / 10 + 0.05, rng=rng)}
    proxy = {"a": _grid(lambda r: 1 - 1 / r), "b": _grid(lambda r: 1 - 1 / r)}
    ds = _dataset(post, proxy)
    plain, points = report.rank_correlation(ds, "mqar", 8)
    partial, _ = report.rank_correlation(ds, "mqar", 8, "proxy_partial_rank_correlation")
    assert points == 10 and float(plain.sel(stat="estimate")) > 0.8
    assert np.isnan(float(partial.sel(stat="estimate")))


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_partial_correlation_is_the_residual_agreement(sign):
    """Proxy and post hoc share log₂ r plus an estimator offset: the same sign of offset gives partial ρ near +1,
    opposite signs near −1, with the plain ρ positive in both cases (log₂ r dominates)."""
    offsets = {"a": -0.3, "b": 0.0, "c": 0.3}
    post = {k: _grid(lambda r, o=o: np.log2(r) + o) for k, o in offsets.items()}
    proxy = {k: _grid(lambda r, o=o: np.log2(r) + sign * o) for k, o in offsets.items()}
    ds = _dataset(post, proxy)
    plain = report.rank_correlation(ds, "mqar", 8)[0]
    partial = report.rank_correlation(ds, "mqar", 8, "proxy_partial_rank_correlation")[0]
    assert float(plain.sel(stat="estimate")) > 0.8
    assert float(partial.sel(stat="estimate")) * sign > 0.95


def _pairs(seeds: int, rng) -> xr.Dataset:
    """a beats b post hoc by 0.1 in every seed while the proxy prefers b; c and d differ post hoc only by noise;
    taylor (fixed dimension 561, in the r = 64 column) must not be paired with anything."""
    noise = lambda: 0.02 * rng.normal(size=(len(RANKS), seeds, 4))   # noqa: E731
    post = {"a": 0.5 + noise(), "b": 0.4 + noise(), "c": 0.3 + noise(), "d": 0.3 + noise(),
            "taylor": np.where(np.asarray(RANKS)[:, None, None] == 64, 0.9, np.nan) * np.ones((1, seeds, 4))}
    proxy = {"a": 0.6 + noise(), "b": 0.7 + noise(), "c": 0.5 + noise(), "d": 0.55 + noise(),
             "taylor": post["taylor"] + 0.05}
    return _dataset(post, proxy, seeds=seeds, fixed={"taylor": 561.0})


def test_within_r_pairs_give_the_right_verdicts():
    ds = _pairs(12, np.random.default_rng(1))
    pairs = report.within_r_pairs(ds, "mqar", 8)
    assert len(pairs) == 6 * len(RANKS) and not any("taylor" in p for p in map(str, pairs))
    out = report.pair_agreement(ds)
    agreement = out["proxy_pair_agreement"].sel(task="mqar", context=8)
    assert (agreement.sel(pair="a vs b") == report.DISAGREE).all()           # proxy prefers the post-hoc loser
    assert (agreement.sel(pair="a vs c") == report.AGREE).all()              # a beats c in both
    assert (agreement.sel(pair="c vs d") == report.UNRESOLVED).all()         # no post-hoc difference
    p = out["proxy_pair_p"].sel(task="mqar", context=8, pair="a vs b")
    np.testing.assert_allclose(p, 2 * 0.5 ** 12)                             # exact sign test, 12 of 12
    holm = out["proxy_pair_p_holm"].sel(task="mqar", context=8)
    np.testing.assert_allclose(holm.values, report.stats.holm(out["proxy_pair_p"].sel(task="mqar", context=8).values))
    diff = out["proxy_pair_post_hoc"].sel(task="mqar", context=8, pair="a vs b", stat="estimate")
    np.testing.assert_allclose(diff, (ds.score.sel(estimator="a") - ds.score.sel(estimator="b")).isel(
        task=0, substitution=0, context=0).mean(("seed", "episode")), rtol=1e-12)
    counts = report._agreement_counts(ds.assign(out), "mqar", 8)
    assert counts == {"pairs": 30, "agree": 20, "disagree": 5, "ties": 0, "resolved": 25}


def test_fewer_than_min_units_seeds_resolve_no_pair():
    """Five seeds: even a pair that differs in every seed stays 'not resolved' (0), never agree or disagree."""
    out = report.pair_agreement(_pairs(5, np.random.default_rng(2)))
    agreement = out["proxy_pair_agreement"].sel(task="mqar", context=8)
    assert (agreement == report.UNRESOLVED).all()


def test_proxy_only_estimators_run_where_the_proxy_reads_them():
    mqar, regression = trained_icl.SETUPS["mqar"], trained_icl.SETUPS["regression"]
    assert trained_icl.applicable(mqar, "all", "trig_orthogonal", 16, 8, 2)
    assert not trained_icl.applicable(mqar, "layer0", "trig_orthogonal", trained_icl.FIXED_SLOT, 8, 2)
    assert not trained_icl.applicable(regression, "all", "trig_orthogonal", 16, 8, 8)
    assert not trained_icl.applicable(mqar, "trained", "trig_orthogonal", 16, 8, 2)
    assert len(trained_icl.GRIDS["default"]["seed"]) >= report.stats.MIN_UNITS


def test_nystrom_proxy_reads_at_most_n_landmarks():
    """The proxy's Nyström reads min(r, n) landmarks from an episode's n keys: at r > n it is the r = n read-out
    (defined, not NaN), which spans every key."""
    import torch

    from kernapprox import tasks

    params = {"context": 4, **trained_icl.EXPERIMENT.parameter_values()}
    episodes = tasks.associative_recall(4, dim=16, value_dim=16, num_candidates=64, batch=3, rng=0,
                                        device=torch.device("cpu"))
    wide = trained_icl._proxy("nystrom_uniform", 64, params, episodes, np.random.default_rng(0))
    at_n = trained_icl._proxy("nystrom_uniform", 4, params, episodes, np.random.default_rng(0))
    np.testing.assert_array_equal(wide["proxy_accuracy"], at_n["proxy_accuracy"])
    assert trained_icl._proxy("window_linear", 64, params, episodes, np.random.default_rng(0)) == {}


def test_post_hoc_seeds_limit_the_post_hoc_cells_of_a_setup_only():
    """regression's post-hoc cells run on its first post_hoc_seeds seeds; its trained models and MQAR on every
    seed of the grid."""
    from experiments import trained_icl

    reg, mqar = trained_icl.SETUPS["regression"], trained_icl.SETUPS["mqar"]
    assert reg.post_hoc_seeds == 5 and mqar.post_hoc_seeds is None
    args = ("all", "positive_orthogonal", 64, 11, 8)
    assert trained_icl.applicable(reg, *args, seed=4) and not trained_icl.applicable(reg, *args, seed=5)
    assert trained_icl.applicable(mqar, "all", "positive_orthogonal", 64, 8, 2, seed=11)
    assert trained_icl.applicable(reg, "trained", "exact", trained_icl.FIXED_SLOT, 11, 8, seed=11)
