"""What a new user hits first ([4/8] items 7 and 9): parameters that cannot be honoured, confusing messages for
common mistakes, arguments refused late. Each test failed before the fix it names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kernapprox as ka
from kernapprox import distributions, readout
from kernapprox.estimators.deterministic import DPFPFeatures
from kernapprox.nn import KernelAttention

ROOT = Path(__file__).resolve().parents[1]


def test_fixed_dimension_map_refuses_a_feature_count_it_cannot_honour():
    """make_estimator("taylor2", num_features=256) used to give 153 features silently (d = 16)."""
    with pytest.raises(ValueError, match=r"num_features=256 cannot be honoured: .*dimension 153 at d=16"):
        ka.make_estimator("taylor2", num_features=256).fit(torch.zeros(1, 16))
    assert ka.make_estimator("taylor2", num_features=None).fit(torch.zeros(1, 16)).num_features == 153


def test_registry_command_has_a_help_and_no_runpy_warning():
    result = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "kernapprox.estimators", "--help"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "usage:" in result.stdout and "RuntimeWarning" not in result.stderr


def test_attention_readout_refuses_four_dimensional_tensors_clearly():
    """Used to fail with "too many values to unpack"."""
    q, k, v = (torch.zeros(2, 3, 5, 4) for _ in range(3))
    with pytest.raises(ValueError, match=r"queries must be 3-D \(episodes, tokens, features\).*\(2, 3, 5, 4\)"):
        readout.attention_readout("positive", q, k, v, beta=0.5, num_features=8, rng=0)


@pytest.mark.parametrize("where", ["make_estimator", "KernelAttention", "distribution"])
def test_torch_generator_is_refused_naming_rng_and_the_accepted_types(where):
    """Used to say "must be ... Generator, got Generator"."""
    calls = {"make_estimator": lambda: ka.make_estimator("positive", num_features=4, rng=torch.Generator()).fit(
                 torch.zeros(1, 4)),
             "KernelAttention": lambda: KernelAttention(8, 2, "positive", num_features=4, rng=torch.Generator()),
             "distribution": lambda: distributions.make_distribution("isotropic").sample(4, d=4,
                                                                                       rng=torch.Generator())}
    with pytest.raises(TypeError) as info:
        calls[where]()
    text = str(info.value)
    assert text.startswith("rng must be None, a non-negative int seed, a numpy.random.SeedSequence or a "
                           "numpy.random.Generator; got a torch.Generator"), text
    assert "pass an int seed" in text


def test_unknown_sampler_lists_only_documented_samplers():
    """The message listed "halton", which no document mentions; it lists the registered variants now."""
    from kernapprox.estimators.samplers import SAMPLER_VARIANTS

    with pytest.raises(ValueError) as info:
        ka.make_estimator("positive", num_features=4, sampler="sobol")
    assert str(info.value) == f"unknown sampler 'sobol'; valid values: {', '.join(('iid', *SAMPLER_VARIANTS))}"
    assert "halton" not in str(info.value) and "orthogonal" in str(info.value)


def _unavailable_cuda():
    return "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"


@pytest.mark.parametrize("where", ["distribution", "KernelAttention"])
def test_unavailable_cuda_device_is_a_clear_value_error(where):
    """Used to be torch's raw AssertionError ("Torch not compiled with CUDA enabled")."""
    device = _unavailable_cuda()
    with pytest.raises(ValueError, match=r"device 'cuda(:\d+)?' is not available"):
        if where == "distribution":
            distributions.make_distribution("isotropic").sample(4, d=4, rng=0, device=device)
        else:
            KernelAttention(8, 2, "positive", num_features=4, rng=0, device=device)


@pytest.mark.parametrize("name", ka.available_estimators())
@pytest.mark.parametrize("scale", [0, 0.0, -1.0, float("nan")])
def test_bad_scale_is_refused_at_construction(name, scale):
    """scale=0 used to be accepted by the constructor and refused only at the first fit."""
    options = {"window": 3} if name in ("window_linear", "scatterbrain") else {}
    size = None if ka.capabilities(name).fixed_dimension else 4
    with pytest.raises(ValueError, match="scale"):
        ka.make_estimator(name, num_features=size, scale=scale, **options)


def test_no_silent_zeros_from_exact_scale_features_on_unscaled_data():
    """The user-facing face of item 1: the feature map of large inputs either is right or says why not."""
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((4, 13)) * 300)
    est = ka.make_estimator("positive_orthogonal", num_features=64, rng=0).fit(x)
    with pytest.raises(ValueError, match="underflow"):
        est.features(x)
    y = ka.linear_attention(x[None], x[None], x[None], est)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("name", ["taylor2", "taylor2_based", "elu1", "dpfp"])
def test_deterministic_maps_of_zero_and_huge_vectors(name):
    """A zero row (as in integer data) gave NaN Taylor features (0·log 0); huge rows overflowed the powers of the
    norm. Both are now exact: φ(0) = e_0 for Taylor, and the features of 1e15-norm rows are finite."""
    est = (DPFPFeatures(nu=1) if name == "dpfp" else ka.make_estimator(name)).fit(torch.zeros(1, 3))
    zero = est.features(torch.zeros(2, 3, dtype=torch.float64))
    assert not torch.isnan(zero).any()
    if name.startswith("taylor2"):
        assert torch.equal(zero, torch.nn.functional.one_hot(torch.zeros(2, dtype=torch.long), zero.shape[-1])
                           .double())
    tilde, logs = est.features(torch.full((2, 3), 1e15), log_scale=True)
    assert torch.isfinite(tilde).all() and torch.isfinite(logs).all()
