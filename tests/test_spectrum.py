"""Spectrum of the exact kernel: known spectra, Eckart–Young errors and ranks, and the spectrum study's smoke run."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import kernapprox as ka
from kernapprox.estimators.samplers import haar_orthogonal
from kernapprox.spectrum import (
    attention_singular_values,
    eckart_young_errors,
    joint_kernel_singular_values,
    kernel_singular_values,
    rank_for_relative_error,
    smallest_size_reaching,
)

REPO = Path(__file__).resolve().parents[1]
SIGMA = np.array([10.0, 5.0, 2.0, 1.0, 0.5, 0.1])


def _matrix_with_spectrum(sigma, n_rows, n_cols, seed):
    rng = np.random.default_rng(seed)
    u = haar_orthogonal(n_rows, rng)[:, : sigma.size]
    v = haar_orthogonal(n_cols, rng)[:, : sigma.size]
    return (u * sigma) @ v.T


def test_eckart_young_errors_match_truncated_svd_of_a_known_spectrum():
    a = _matrix_with_spectrum(SIGMA, 9, 7, seed=0)
    sv = np.linalg.svd(a, compute_uv=False)
    np.testing.assert_allclose(sv[: SIGMA.size], SIGMA, rtol=1e-12)
    errors = eckart_young_errors(SIGMA)
    total = math.sqrt((SIGMA**2).sum())
    expected = [math.sqrt((SIGMA[r:] ** 2).sum()) / total for r in range(SIGMA.size)] + [0.0]
    np.testing.assert_allclose(errors, expected, rtol=1e-13, atol=0)
    u, s, vh = np.linalg.svd(a)
    for r in range(SIGMA.size + 1):  # the formula is the error of the actual truncated SVD
        approx = (u[:, :r] * s[:r]) @ vh[:r]
        assert abs(np.linalg.norm(a - approx) / np.linalg.norm(a) - errors[r]) < 1e-12


@pytest.mark.parametrize("r", range(SIGMA.size))
def test_rank_for_relative_error_at_and_between_the_known_errors(r):
    errors = eckart_young_errors(SIGMA)
    assert rank_for_relative_error(SIGMA, errors[r]) == r                           # reached exactly at r
    assert rank_for_relative_error(SIGMA, errors[r] * (1 - 1e-9)) == r + 1          # just below: one more
    assert rank_for_relative_error(SIGMA, 1.5) == 0


def test_rank_for_relative_error_is_batched_and_handles_tiny_tails():
    sv = np.stack([SIGMA, SIGMA * 3.0])
    np.testing.assert_array_equal(rank_for_relative_error(sv, 0.05), [4, 4])
    tiny = np.array([1.0, 1e-9, 1e-10])          # tail energy ~1e-18 must not vanish in the sum
    assert rank_for_relative_error(tiny, 1.1e-9) == 1          # e_1 = sqrt(1.01e-18) ≈ 1.005e-9
    assert rank_for_relative_error(tiny, 1.0e-9) == 2
    assert rank_for_relative_error(tiny, 0.99e-10) == 3


def test_kernel_spectra_of_a_known_exp_kernel():
    # Q = K = a·I_n (n = d): exp(s QKᵀ) = J + c·I with c = e^{s a²} − 1; eigenvalues n + c and c (n − 1 times).
    n, a = 6, 1.7
    q = a * torch.eye(n, dtype=torch.float64)
    s = 1.0 / math.sqrt(n)
    c = math.exp(s * a * a) - 1.0
    expected = np.array([n + c] + [c] * (n - 1))
    np.testing.assert_allclose(kernel_singular_values(q, q.clone()), expected / expected[0], rtol=1e-12)
    # Rows of J + cI sum to n + c: P = (J + cI)/(n + c) has the same normalised spectrum.
    np.testing.assert_allclose(attention_singular_values(q, q.clone()), expected / expected[0], rtol=1e-12)
    # Joint [Q; K] with K = Q: [[M, M], [M, M]] has eigenvalues 2·eig(M) and n zeros.
    joint = joint_kernel_singular_values(q, q.clone())
    np.testing.assert_allclose(joint[:n], expected / expected[0], rtol=1e-12)
    assert np.all(np.abs(joint[n:]) < 1e-12)


def test_kernel_singular_values_agree_with_the_optimal_low_rank_estimator():
    rng = np.random.default_rng(3)
    q = torch.from_numpy(rng.standard_normal((2, 40, 8)))
    k = torch.from_numpy(rng.standard_normal((2, 30, 8)))
    ours = kernel_singular_values(q, k)
    assert ours.shape == (2, 30)
    if "kernel_svd" in ka.available_estimators():
        est = ka.make_estimator("kernel_svd", num_features=4).fit(q, k)
        theirs = est.singular_values(q, k)
        np.testing.assert_allclose(ours, (theirs / theirs[..., :1]).numpy(), rtol=1e-9, atol=1e-15)


def test_kernel_singular_values_stay_finite_at_huge_temperatures():
    rng = np.random.default_rng(1)
    q = torch.from_numpy(rng.standard_normal((16, 4)) * 40.0)      # logits up to ~10^4: exp overflows unshifted
    sv = kernel_singular_values(q, q.clone())
    assert np.isfinite(sv).all() and sv[0] == 1.0
    assert np.isfinite(attention_singular_values(q, q.clone())).all()


@pytest.mark.parametrize("bad, exc", [([3.0, -1.0], ValueError), ([1.0, 2.0], ValueError), ([], ValueError),
                                      ([1.0, np.nan], ValueError), (["a", "b"], TypeError)])
def test_singular_value_validation(bad, exc):
    with pytest.raises(exc):
        rank_for_relative_error(np.array(bad), 0.1)


def test_target_and_grid_validation():
    with pytest.raises(ValueError, match="target"):
        rank_for_relative_error(SIGMA, 0.0)
    assert smallest_size_reaching([0.5, 0.09, 0.01], [4, 8, 16], 0.1) == 8
    assert math.isnan(smallest_size_reaching([0.5, np.nan, 0.2], [4, 8, 16], 0.1))
    with pytest.raises(ValueError, match="increasing"):
        smallest_size_reaching([0.5, 0.1], [8, 4], 0.1)


def test_spectrum_smoke_preset_runs_and_plots(tmp_path):
    pytest.importorskip("kernapprox.sweep")
    from experiments import spectrum
    from kernapprox.sweep import run

    ds = run(spectrum.EXPERIMENT, preset="smoke", out=tmp_path / "spectrum.nc", device="cpu")
    ns = ds.seq_len.values
    rank = ds["rank_kernel"]
    assert np.isfinite(rank).all()
    assert (rank.sel(target=0.01) >= rank.sel(target=0.1)).all()
    assert (rank <= xr_broadcast(ns, rank)).all()
    assert float(ds["kernel_sv"].isel(sv_index=0).min()) == 1.0
    text = ds["distinct_queries"].sel(data="text_like")
    assert (text <= xr_broadcast(ns, text)).all()
    # the sweep stops an estimator once it reaches the targets, and never exceeds m = n
    assert np.isnan(ds["kernel_error"].sel(num_features=128)).all()
    spectrum.EXPERIMENT.plot(ds, tmp_path / "spectrum.png")
    assert (tmp_path / "spectrum.png").stat().st_size > 10_000


def xr_broadcast(ns, da):
    import xarray as xr

    return xr.DataArray(ns, dims=("seq_len",), coords={"seq_len": ns}).broadcast_like(da)
