"""The in-weight learners (kernapprox.in_weight) against their closed forms, and the ``in_context_vs_in_weight``
study: its smoke preset runs through the engine with every predictor on the same episodes, its memory accounting
follows the formulas it states, and its findings come from the dataset."""

import math

import numpy as np
import pytest
import torch

from experiments import in_context_vs_in_weight as study
from kernapprox import in_weight, readout, sweep, tasks
from kernapprox.plotting import fmt_ci

CPU = torch.device("cpu")


def unit_rows(gen, *shape):
    x = gen.standard_normal(shape)
    return torch.as_tensor(x / np.linalg.norm(x, axis=-1, keepdims=True))


# --------------------------------------------------------------------------------------- the library
def test_empirical_ntk_of_a_linear_model_is_the_linear_kernel():
    """f(x) = Wᵀx + b has Jacobian (x, 1) in every output's own parameters: Θ(x, x') = xᵀx' + 1 exactly."""
    gen = np.random.default_rng(0)
    x1, x2 = torch.as_tensor(gen.standard_normal((5, 3))), torch.as_tensor(gen.standard_normal((7, 3)))
    params = {"w": torch.as_tensor(gen.standard_normal((3, 4))), "b": torch.as_tensor(gen.standard_normal(4))}
    ntk = in_weight.empirical_ntk(lambda p, x: x @ p["w"] + p["b"], params, x1, x2)
    torch.testing.assert_close(ntk, x1 @ x2.T + 1.0, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("outputs", [1, 3])
def test_two_layer_ntk_closed_form_equals_the_jacobian_product(outputs):
    gen = np.random.default_rng(1)
    net = in_weight.init_two_layer(4, 37, outputs, batch=2, rng=2)
    x1, x2 = unit_rows(gen, 2, 6, 4), 1.7 * unit_rows(gen, 2, 5, 4)        # off the sphere too
    closed = in_weight.two_layer_ntk(net, x1, x2)
    for b in range(2):
        params = {"weight": net.weight[b], "bias": net.bias[b], "readout": net.readout[b]}

        def fn(p, x):
            one = in_weight.TwoLayerNetwork(p["weight"][None], p["bias"][None], p["readout"][None])
            return in_weight.two_layer_forward(one, x[None])[0]

        torch.testing.assert_close(closed[b], in_weight.empirical_ntk(fn, params, x1[b], x2[b]), rtol=1e-10,
                                   atol=1e-12)


def test_init_is_one_draw_in_every_dtype_and_the_centred_network_starts_at_zero():
    a = in_weight.init_two_layer(3, 8, 2, batch=2, rng=5, dtype=torch.float64)
    b = in_weight.init_two_layer(3, 8, 2, batch=2, rng=5, dtype=torch.float32)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.float(), q)
    assert a.num_parameters == 3 * 8 + 8 + 8 * 2 and a.width == 8
    x = unit_rows(np.random.default_rng(0), 2, 4, 3)
    assert torch.equal(in_weight.centred_forward(a, a, x), torch.zeros(2, 4, 2, dtype=torch.float64))


def test_kernel_ridge_interpolates_as_the_ridge_vanishes_and_ignores_the_kernel_scale():
    gen = np.random.default_rng(3)
    x, q = unit_rows(gen, 2, 12, 4), unit_rows(gen, 2, 5, 4)
    y = torch.as_tensor(gen.standard_normal((2, 12, 2)))
    gram, cross = torch.exp(4.0 * x @ x.transpose(1, 2)), torch.exp(4.0 * q @ x.transpose(1, 2))
    fitted = in_weight.kernel_ridge(gram, gram, y, ridge=1e-12)
    torch.testing.assert_close(fitted, y, rtol=0, atol=1e-6)                 # λ → 0: the examples are interpolated
    lam = 0.1 * torch.diagonal(gram, dim1=1, dim2=2).mean(-1)[:, None, None]
    expected = cross @ torch.linalg.solve(gram + lam * torch.eye(12, dtype=torch.float64), y)
    torch.testing.assert_close(in_weight.kernel_ridge(gram, cross, y, ridge=0.1), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(in_weight.kernel_ridge(7.0 * gram, 7.0 * cross, y, ridge=0.1), expected, rtol=1e-10,
                               atol=1e-12)                                   # the ridge is relative to the kernel


def test_nadaraya_watson_is_the_exact_attention_read_out():
    """ŷ(q) = Σ exp(β qᵀk_i) v_i / Σ exp(β qᵀk_i), written out in float64, is the read-out the study calls
    attention (exact softmax attention, float32) to float32 tolerance, off the sphere too."""
    gen = np.random.default_rng(4)
    k, v = unit_rows(gen, 3, 40, 4), torch.as_tensor(gen.standard_normal((3, 40, 2)))
    q = torch.cat([unit_rows(gen, 3, 8, 4), 2.0 * unit_rows(gen, 3, 8, 4)], dim=1)
    beta = 16.0
    weights = torch.exp(beta * (q @ k.transpose(1, 2)) - beta * 2.0)        # a constant factor cancels
    smoother = (weights @ v) / weights.sum(-1, keepdim=True)
    read = readout.attention_readout("exact", q.float(), k.float(), v.float(), beta=beta)
    torch.testing.assert_close(read.output.double(), smoother, rtol=1e-4, atol=1e-5)


def test_linearised_descent_is_the_spectral_filter_of_early_stopped_kernel_regression():
    gen = np.random.default_rng(6)
    net = in_weight.init_two_layer(4, 64, 1, batch=2, rng=7)
    x, q = unit_rows(gen, 2, 10, 4), unit_rows(gen, 2, 3, 4)
    y = torch.as_tensor(gen.standard_normal((2, 10, 1)))
    gram, cross = in_weight.two_layer_ntk(net, x, x), in_weight.two_layer_ntk(net, q, x)
    lr, steps = in_weight.ntk_step_size(gram), 25
    out = in_weight.linearised_gradient_descent(gram, cross, y, loss="mse", steps=steps, lr=lr)
    evals, evecs = torch.linalg.eigh(gram)
    filt = (1.0 - (1.0 - lr[:, None] * evals / 10) ** steps) / evals           # Θ⁻¹[I − (I − ηΘ/n)^T]
    expected = cross @ evecs @ (filt[..., None] * (evecs.transpose(1, 2) @ y))
    torch.testing.assert_close(out, expected, rtol=1e-8, atol=1e-10)
    top = torch.linalg.eigvalsh(lr[:, None, None] * gram / 10)[:, -1]
    torch.testing.assert_close(top, torch.ones(2, dtype=torch.float64))       # the step's largest eigenvalue is 1


def test_gradient_descent_approaches_its_linearisation_as_the_network_widens():
    """Lee et al. 2019: the trained network stays within O(1/sqrt(m)) of its linearisation. Same examples and
    step size at widths 64 and 4096; the relative gap must shrink by more than half (√64 = 8 in theory)."""
    gen = np.random.default_rng(8)
    x, q = unit_rows(gen, 1, 16, 4), unit_rows(gen, 1, 8, 4)
    y = torch.as_tensor(np.sin(3.0 * x[..., :1].numpy()))
    gaps = []
    for width in (64, 4096):
        net = in_weight.init_two_layer(4, width, 1, rng=9)
        gram, cross = in_weight.two_layer_ntk(net, x, x), in_weight.two_layer_ntk(net, q, x)
        lr = in_weight.ntk_step_size(gram)
        lin = in_weight.linearised_gradient_descent(gram, cross, y, loss="mse", steps=50, lr=lr)
        trained = in_weight.gradient_descent(net, x, y, loss="mse", steps=50, lr=lr)
        gaps.append(float((in_weight.centred_forward(trained, net, q) - lin).norm() / lin.norm()))
    assert gaps[1] < 0.5 * gaps[0] and gaps[1] < 0.05, gaps


def test_gradient_descent_trains_each_episode_on_its_own_examples():
    gen = np.random.default_rng(10)
    net = in_weight.init_two_layer(4, 16, 3, batch=2, rng=11)
    x = unit_rows(gen, 2, 6, 4)
    y = torch.nn.functional.one_hot(torch.as_tensor(gen.integers(0, 3, (2, 6))), 3).double()
    both = in_weight.gradient_descent(net, x, y, loss="cross_entropy", steps=5, lr=torch.tensor([0.5, 2.0]))
    for b, lr in enumerate((0.5, 2.0)):
        alone = in_weight.TwoLayerNetwork(*(p[b:b + 1] for p in net))
        one = in_weight.gradient_descent(alone, x[b:b + 1], y[b:b + 1], loss="cross_entropy", steps=5, lr=lr)
        for p, r in zip(both, one):
            torch.testing.assert_close(p[b:b + 1], r, rtol=1e-12, atol=1e-12)


def test_bad_arguments_are_refused_by_name():
    net = in_weight.init_two_layer(4, 8, 1, batch=1, rng=0)
    x = torch.zeros(1, 3, 4, dtype=torch.float64)
    gram = torch.eye(3, dtype=torch.float64)[None]
    with pytest.raises(ValueError, match="ridge"):
        in_weight.kernel_ridge(gram, gram, x[..., :1], ridge=0.0)
    with pytest.raises(ValueError, match="positive definite"):
        in_weight.kernel_ridge(-gram, gram, x[..., :1], ridge=1e-3)
    with pytest.raises(ValueError, match="loss"):
        in_weight.gradient_descent(net, x, x[..., :1], loss="hinge", steps=1, lr=0.1)
    with pytest.raises(TypeError, match="net"):
        in_weight.two_layer_forward(net._asdict(), x)
    with pytest.raises(ValueError, match="x must have shape"):
        in_weight.two_layer_forward(net, torch.zeros(1, 3, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="targets"):
        in_weight.gradient_descent(net, x, torch.zeros(1, 3, 2, dtype=torch.float64), loss="mse", steps=1, lr=0.1)
    with pytest.raises(ValueError, match="lr"):
        in_weight.linearised_gradient_descent(gram, gram, x[..., :1], loss="mse", steps=1, lr=torch.zeros(1))
    with pytest.raises(ValueError, match="width"):
        in_weight.init_two_layer(4, 0, 1)


# ------------------------------------------------------------------------------------------- the study
@pytest.fixture(scope="module")
def smoke(smoke_run):
    return smoke_run("in_context_vs_in_weight")[1]


def test_smoke_dataset(smoke):
    ds = smoke
    assert list(ds.predictor.values) == list(study.PREDICTORS) and list(ds.query_set.values) == list(study.QUERY_SETS)
    assert ds["error"].dims == ("task", "predictor", "num_context", "seed", "episode", "query_set")
    for name in ("error_summary", "error_vs_attention_summary", "error_vs_attention_p_holm", "gd_vs_linearised",
                 "memory"):
        assert ds[name].attrs["long_name"] and ds[name].attrs["units"]
    # not applicable: the GP reference off the regression task, Nyström with more landmarks than examples
    assert ds["error"].sel(task="classification", predictor="gp_posterior").isnull().all()
    assert ds["error"].sel(predictor="gp_posterior", task="regression").notnull().all()
    small = int(ds.num_context.min())
    assert ds["error"].sel(predictor="nystrom_r64", num_context=small).isnull().all()
    assert ds["error"].drop_sel(predictor=["gp_posterior", "nystrom_r64"]).notnull().all()
    # Nyström with every example as a landmark is exact attention on the same episodes (the pairing)
    at = {"predictor": "nystrom_r16", "num_context": 16}
    np.testing.assert_allclose(ds["error"].sel(at), ds["error"].sel(predictor="attention", num_context=16),
                               rtol=1e-4, atol=1e-6)
    assert float(abs(ds["error_vs_attention"].sel(predictor="attention")).max()) == 0.0
    # 1-NN reads the direction only: a scaled query gets the same prediction
    nn = ds["error"].sel(predictor="nearest_neighbour")
    xr_equal = (nn.sel(query_set="norm_x2") == nn.sel(query_set="in_distribution")).all()
    assert bool(xr_equal)


@pytest.mark.parametrize("task", list(study.TASKS))
def test_memory_follows_the_stated_formulas(smoke, task):
    d, d_v = study.TASKS[task]
    m = int(smoke["width"])
    params = d * m + m + m * d_v
    mem = smoke["memory_bytes"].sel(task=task).isel(seed=0)
    for n in smoke.num_context.values.tolist():
        at = mem.sel(num_context=n)
        assert float(at.sel(predictor="attention")) == 4 * n * (d + d_v)          # the KV cache
        assert float(at.sel(predictor="kernel_ridge")) == 4 * n * (d + d_v)       # examples and coefficients
        assert float(at.sel(predictor="ntk_ridge")) == 4 * (n * (d + d_v) + params)
        assert float(at.sel(predictor="gd")) == 4 * 2 * params                   # trained and initial parameters
        assert float(at.sel(predictor="favor_r16")) == 4 * 16 * (d_v + 1)          # W and z
        assert float(at.sel(predictor="trivial")) == 4 * d_v


def test_summaries_are_cluster_means_of_the_stored_episodes(smoke):
    at = {"task": "regression", "predictor": "ntk_ridge", "num_context": 32, "query_set": "in_distribution"}
    s = smoke["error_summary"].sel(at)
    np.testing.assert_allclose(float(s.sel(stat="estimate")), float(smoke["error"].sel(at).mean()), rtol=1e-12)
    assert float(s.sel(stat="lo")) <= float(s.sel(stat="estimate")) <= float(s.sel(stat="hi"))
    assert int(s.sel(stat="count")) == smoke.sizes["seed"]                   # the unit of replication
    holm = smoke["error_vs_attention_p_holm"].sel(task="regression", query_set="in_distribution")
    raw = smoke["error_vs_attention_p"].sel(task="regression", query_set="in_distribution")
    learners = holm.sel(predictor=study.IN_WEIGHT)
    assert bool((learners >= raw.sel(predictor=study.IN_WEIGHT)).all())
    assert holm.sel(predictor="attention").isnull().all()


def test_the_gp_kernel_on_the_sphere_is_the_tasks_squared_exponential_covariance():
    params = {"task": "regression", "num_context": 16, "seed": 0,
              **{k: p.value for k, p in study.PARAMETERS.items()}}
    data = study.draw(params, np.random.default_rng(0), CPU)
    gram, _ = data.gp_kernel()
    x = data.keys.double()
    ell = params["lengthscale"]
    se = torch.exp(-torch.cdist(x, x).pow(2) / (2 * ell**2))
    torch.testing.assert_close(gram, se, rtol=1e-6, atol=1e-6)
    ep = tasks.smooth_regression(16, dim=4, num_queries=params["regression_queries"], lengthscale=ell,
                                 noise_std=params["noise_std"], batch=params["episodes"],
                                 rng=np.random.default_rng(0))
    torch.testing.assert_close(data.keys, ep.x)                              # the ICL study's episodes
    assert data.queries.shape[1] == len(study.QUERY_SETS) * params["regression_queries"]
    norms = torch.linalg.vector_norm(data.queries, dim=-1).reshape(params["episodes"], len(study.QUERY_SETS), -1)
    torch.testing.assert_close(norms.mean(-1)[0], torch.tensor(list(study.QUERY_SETS.values())))


def test_findings_come_from_the_dataset(smoke, tmp_path):
    text = sweep.findings_body(study.EXPERIMENT, smoke)
    assert text == sweep.findings_body(study.EXPERIMENT, smoke.copy(deep=True))      # deterministic
    at = {"task": "regression", "query_set": "in_distribution", "num_context": 32}
    assert f"attention {fmt_ci(smoke['error_summary'].sel({**at, 'predictor': 'attention'}))}" in text
    assert "not resolved" in text                                            # 2 seeds never resolve a verdict
    written = sweep.draw(study.EXPERIMENT, smoke, tmp_path / "figure.png", source="results/x.nc")
    png = next(p for p in written if p.suffix == ".png")
    assert png.stat().st_size > 10_000 and math.isfinite(float(smoke["memory"].max()))
