"""experiments.causal_lm: SmolLM2-135M converted layer by layer, paired with the exact model on the same windows and
prompts; its smoke preset end to end (marker ``lm``), and the placement of the kept softmax layers."""

from __future__ import annotations

import numpy as np
import pytest

from experiments import _lm, causal_lm
from kernapprox import lm, sweep


def test_kept_softmax_layers_are_evenly_spaced_or_the_most_sensitive():
    assert causal_lm.substituted_layers(0) == list(range(30))
    kept = sorted(set(range(30)) - set(causal_lm.substituted_layers(15)))
    assert kept == list(range(0, 30, 2))
    assert sorted(set(range(30)) - set(causal_lm.substituted_layers(6))) == [0, 5, 10, 15, 20, 25]
    assert len(causal_lm.substituted_layers(29)) == 1
    sensitivity = [0.1] * 30
    sensitivity[7], sensitivity[3], sensitivity[21] = 2.0, 1.5, 1.0
    assert sorted(set(range(30)) - set(causal_lm.substituted_layers(2, sensitivity))) == [3, 7]
    assert sorted(set(range(30)) - set(causal_lm.substituted_layers(3, sensitivity))) == [3, 7, 21]
    assert causal_lm.substituted_layers(0, sensitivity) == list(range(30))
    assert causal_lm.substituted_layers(6, placement="first") == list(range(6, 30))
    assert causal_lm.substituted_layers(6, placement="last") == list(range(24))
    assert causal_lm.substituted_layers(0, placement="last") == list(range(30))
    # the measured sensitivity decides whatever the placement's name
    assert causal_lm.substituted_layers(2, sensitivity, "first") == causal_lm.substituted_layers(2, sensitivity)


def test_kernel_error_sums_are_the_row_normalised_frobenius_error():
    """The chain's first link against its definition, computed naively: per head, the causal kernel matrices of the
    estimator and of exp(s qᵀk), each row divided by its exact normaliser; a head keeping softmax contributes 0."""
    import torch

    import kernapprox as ka
    from kernapprox.surgery.attention import AttentionCall

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 12, 4, generator=gen) * 1.5 for _ in range(3))
    scale = 0.5
    heads = [ka.make_estimator("positive_orthogonal", num_features=8, scale=scale, rng=h).fit(q[:, h], k[:, h])
             for h in range(2)] + [None]
    sums = causal_lm._kernel_error_sums(AttentionCall(q, k, v, None, True, scale), heads)
    for h in range(2):
        exact = torch.exp(scale * q[0, h].double() @ k[0, h].double().T).tril()
        approx = heads[h].kernel_matrix(q[0, h].double(), k[0, h].double()).tril()
        z = exact.sum(-1, keepdim=True)
        assert sums[0, h] == pytest.approx(float(((approx - exact) / z).square().sum()), rel=1e-9)
        assert sums[1, h] == pytest.approx(float((exact / z).square().sum()), rel=1e-9)
    assert sums[:, 2].tolist() == [0.0, 0.0]


def test_maps_preset_runs_every_label_once_and_fixed_maps_report_their_own_dimension():
    """The maps preset is one cell per label (r = hybrid_rank, every layer substituted); a map whose dimension the
    head's fixes is converted with num_features=None and named by that dimension: taylor2 1 + d + d(d+1)/2, elu1 d."""
    grid = causal_lm.GRIDS["maps"]
    assert grid["estimator"] == list(causal_lm.ESTIMATORS)
    cells = [dict(causal_lm.EXPERIMENT.parameter_values(), estimator=e, num_features=r, exact_layers=k, placement=p,
                  context=c, map_seed=s)
             for e in grid["estimator"] for r in grid["num_features"] for k in grid["exact_layers"]
             for p in grid["placement"] for c in grid["context"] for s in grid["map_seed"]]
    assert all(causal_lm.applicable(cell) for cell in cells)
    assert set(causal_lm.FIXED_DIMENSION) == {"taylor2", "elu1"}
    base = {"num_features": 64}
    assert causal_lm.features_per_head({**base, "estimator": "taylor2"}, 64) == 1 + 64 + 64 * 65 // 2
    assert causal_lm.features_per_head({**base, "estimator": "elu1"}, 64) == 64
    assert causal_lm.features_per_head({**base, "estimator": "oprf_orthogonal"}, 64) == 64


def test_bad_cells_are_refused_before_any_runs():
    base = {"estimator": "positive_orthogonal", "num_features": 64, "exact_layers": 0, "placement": "even",
            "context": 512, "map_seed": 0}
    for change, word in (({"estimator": "elu"}, "estimator"), ({"exact_layers": 30}, "exact_layers"),
                         ({"context": 64}, "context"), ({"placement": "middle"}, "placement")):
        with pytest.raises(ValueError, match=word):
            causal_lm.check_params({**base, **change})
    params = {**base, "hybrid_rank": 64}
    assert causal_lm.applicable(params)
    assert not causal_lm.applicable({**params, "placement": "sensitivity"})        # k = 0 is placement "even"
    assert not causal_lm.applicable({**params, "num_features": 16, "exact_layers": 15})
    assert not causal_lm.applicable({**params, "num_features": 16, "estimator": "window_linear"})
    assert causal_lm.applicable({**params, "num_features": 16})                    # FAVOR+'s rank sweep
    assert causal_lm.applicable({**params, "exact_layers": 15})
    window = {**params, "estimator": "window_linear"}
    assert causal_lm.applicable({**window, "exact_layers": 2, "placement": "sensitivity"})
    assert not causal_lm.applicable({**window, "exact_layers": 2})                # no even placement at k = 2
    for placement in ("first", "last"):                                              # at k = 6 only
        assert causal_lm.applicable({**window, "exact_layers": 6, "placement": placement})
        assert not causal_lm.applicable({**window, "exact_layers": 2, "placement": placement})
        assert not causal_lm.applicable({**params, "exact_layers": 6, "placement": placement})
    shared = {**params, "estimator": "positive_orthogonal_shared"}
    assert causal_lm.applicable(shared) and not causal_lm.applicable({**shared, "exact_layers": 15})


@pytest.mark.lm
@pytest.mark.xdist_group("smollm2")
@pytest.mark.skipif(not lm.is_available(), reason=str(lm.unavailable_reason()))
def test_smoke_preset_pairs_every_cell_with_the_exact_model(tmp_path, monkeypatch, user_cache_root):
    """The smoke preset on the real model: every cell's decoding equals its parallel pass to float32 rounding, the
    bytes it keeps are those of its states and kept layers, and the findings and figure come from the dataset."""
    load = lm.load_smollm2
    monkeypatch.setattr(lm, "load_smollm2", lambda **kw: load(cache_root=user_cache_root, **kw))
    ds = sweep.run(causal_lm.EXPERIMENT, preset="smoke", out=tmp_path / "causal_lm.nc", device="cpu",
                   progress=False)
    context, r, d = 96, 64, lm.HEAD_DIM
    kv_layer = 2 * lm.NUM_KV_HEADS * d * context * 4                  # one layer's exact KV cache, float32
    state = lm.NUM_KV_HEADS * r * (d + 1) * 4                         # one layer's FAVOR+ states, one per kv head
    window = lm.NUM_KV_HEADS * 64 * (d + d) * 4                       # window_linear's 64 keys and values per kv head
    assert float(ds["kv_bytes"].sel(context=context)) == lm.NUM_LAYERS * kv_layer == lm.kv_cache_bytes(context)
    assert ds["exact_kv_bytes"].sel(context=context).values.tolist() == [
        lm.kv_cache_bytes(n) for n in causal_lm.DECODE_CONTEXTS]                # measured = the formula
    sel = dict(num_features=r, context=context, map_seed=0)
    every = dict(exact_layers=0, placement="even", **sel)
    sensitive = dict(exact_layers=2, placement="sensitivity", **sel)
    assert float(ds["state_bytes"].sel(estimator="positive_orthogonal", **every)) == 30 * state
    assert float(ds["state_bytes"].sel(estimator="window_linear", **every)) == 30 * (state + window)
    assert float(ds["state_bytes"].sel(estimator="window_linear", **sensitive)) == \
        28 * (state + window) + 2 * kv_layer
    assert float(ds["decode_rel_diff"].max()) < 1e-4                  # the RNN mode is the parallel pass
    assert ds["nll"].sizes["window"] == ds["nll_exact"].sizes["window"] == 10
    # the window hybrid's per-layer sensitivity ran with it, and placed its two softmax layers
    delta = ds["layer_delta_nll"].sel(estimator="window_linear", **every)
    assert bool(np.isfinite(delta).all()) and float(delta.max()) > 0
    assert bool(np.isfinite(ds["layer_attention_error"].sel(estimator="window_linear", **every)).all())
    assert bool(np.isfinite(ds["layer_kernel_error"].sel(estimator="window_linear", **every)).all())
    # greedy agreement with the exact model: a fraction per window, a prefix length of at most n_continue tokens
    top1 = ds["top1_agreement"].sel(estimator="window_linear", **every)
    assert top1.sizes["window"] == 10 and bool(((top1 >= 0) & (top1 <= 1)).all()) and float(top1.mean()) > 0.5
    assert 0 <= float(ds["continuation_match"].sel(estimator="window_linear", **every)) <= int(ds["n_continue"])
    assert bool(np.isnan(ds["layer_delta_nll"].sel(estimator="positive_orthogonal", **every)).all())
    # keeping the two most sensitive layers exact brings the NLL closer to the exact model's on the same windows
    nll = ds["delta_nll_summary"].sel(estimator="window_linear", stat="estimate", **sel)
    assert float(nll.sel(exact_layers=2, placement="sensitivity")) < float(nll.sel(exact_layers=0, placement="even"))
    written = sweep.draw(causal_lm.EXPERIMENT, ds, tmp_path / "causal_lm.png", source="causal_lm.nc")
    md = written[-1].read_text(encoding="utf-8")
    assert md.startswith("- Exact model at 96-token windows") and sweep.read_digest(md) == sweep.dataset_digest(ds)


@pytest.mark.lm
@pytest.mark.xdist_group("smollm2")
@pytest.mark.skipif(not lm.is_available(), reason=str(lm.unavailable_reason()))
def test_sensitivity_passes_from_a_layer_equal_whole_passes(user_cache_root):
    """The per-layer sensitivity's pass for layer l starts at the exact model's input of layer l and runs layer l of
    the every-layer conversion: the NLL of a whole pass through a conversion of layer l alone, to the last bit."""
    from kernapprox import lm_eval

    model, tokenizer = lm.load_smollm2(cache_root=user_cache_root)
    ids = lm.text_windows(tokenizer, 1, 96, split="calibration").input_ids
    data = causal_lm.Draw(model, tokenizer, None, None, ids, {}, None, None, {})
    params = {"estimator": "window_linear", "num_features": 64, "exact_layers": 0, "placement": "even",
              "context": 96, "map_seed": 0, "hybrid_rank": 64}
    inputs, nll = _lm.layer_inputs(model, ids)
    assert len(inputs) == lm.NUM_LAYERS
    np.testing.assert_array_equal(nll, lm_eval.token_nll(model, ids))
    every = causal_lm.convert(data, params)
    exact_layers = list(model.model.layers)
    delta = _lm.layer_delta_nll(model, every, [ids])                # distillation's per-layer analysis
    for layer in (0, 13, 29):
        alone = causal_lm.convert(data, params, layers=[layer])
        suffix = _lm.suffix_nll(every, ids, inputs[layer], [every.model.layers[layer], *exact_layers[layer + 1:]])
        np.testing.assert_array_equal(suffix, lm_eval.token_nll(alone, ids))
        assert delta[layer] == pytest.approx(lm_eval.token_nll(alone, ids).mean() - nll.mean(), abs=1e-12)


def test_a_cell_is_named_by_its_label_and_r_even_where_that_placement_did_not_run():
    """The placement findings name the label's every-layer cell with the placement of the compared one, which never
    runs (k = 0 runs as "even" only): its features per head come from any cell of the label and r."""
    import xarray as xr

    coords = {"estimator": ["taylor2", "window_linear"], "num_features": [64], "exact_layers": [0, 6],
              "placement": ["even", "sensitivity"], "map_seed": [0]}
    values = np.full((2, 1, 2, 2, 1), np.nan)
    values[0, 0, 0, 0, 0] = 2145.0                                   # taylor2, k = 0, even
    values[1, 0, 0, 0, 0] = values[1, 0, 1, 1, 0] = 64.0             # window_linear, k = 0 even and k = 6 sensitivity
    ds = xr.Dataset({"features_per_head": (tuple(coords), values)}, coords=coords)
    cell = {"estimator": "window_linear", "num_features": 64, "exact_layers": 0, "placement": "sensitivity",
            "map_seed": 0}
    assert causal_lm._name(cell, ds) == "`window_linear` at r = 64"
    assert causal_lm._name(dict(cell, estimator="taylor2", placement="even"), ds) == "`taylor2` at r = 2145"
