"""The compiled chunked kernels (:mod:`kernapprox.attention.native`), causal and non-causal: equal to the eager
chunked code to float32 rounding in every case they take (sum and decay rules, padded keys, a carried state,
partial chunks and blocks, the parts and the final state, one and two threads; for the non-causal kernel, which
computes the features itself, every registered map it accepts and more queries than keys), used exactly when
eligible, and a failed build or a wrong kernel falls back to the eager code with one warning. The causal kernel
runs in two forms, features given (any map) and features computed inside (the exponential maps): both are tested.

"Equal to rounding": the largest difference from the eager float32 result is at most four times the eager
result's own float32 error (against the float64 computation) plus ``64 ε`` of the largest value (as for the fused
feature maps, tests/estimators/test_fused.py). Feature maps run eagerly here (``fused.use_fused`` patched to False), so
that only the kernel differs between the two runs.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from helpers import _rounding_close, data

import kernapprox as ka
from kernapprox import backends
from kernapprox.attention import native
from kernapprox.estimators import fused
from kernapprox.rules import SENTINEL

pytestmark = pytest.mark.skipif(not native._prerequisites()[0], reason=native._prerequisites()[1])


@pytest.fixture
def kernel_only(monkeypatch):
    """The switch on, feature maps eager, and a count of the kernel's calls (after its load and self-check)."""
    assert native._load(), native.status()
    monkeypatch.setattr(fused, "use_fused", lambda *args, **kwargs: False)
    calls = []
    real, real_noncausal, real_causal_exp = native.chunk_block, native.noncausal, native.causal_exp

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    def counted_noncausal(forms, *args, **kwargs):
        calls.append(("non-causal", forms[0].rows.shape[0], forms[0].rows.shape[1], forms[1].rows.shape[1]))
        return real_noncausal(forms, *args, **kwargs)

    def counted_causal_exp(forms, *args, **kwargs):
        calls.append(("causal, features inside", forms[0].rows.shape[0], forms[0].rows.shape[1]))
        return real_causal_exp(forms, *args, **kwargs)

    monkeypatch.setattr(native, "chunk_block", counted)
    monkeypatch.setattr(native, "noncausal", counted_noncausal)
    monkeypatch.setattr(native, "causal_exp", counted_causal_exp)
    with backends.mode("native", "on"):
        yield calls


def _compare(q, k, v, est, what, **call):
    """Every part and the final state: the kernel (switch on) against the eager code (switch off) and float64."""
    call = {"causal": True, "mode": "chunked", "return_parts": True, "return_state": True, **call}
    call64 = dict(call)
    if call.get("initial_state") is not None:
        call64["initial_state"] = type(call["initial_state"])(*(t.double() for t in call["initial_state"]))
    with backends.mode("native", "off"):
        ref, ref_state = ka.linear_attention(q, k, v, est, **call)
        ref64, ref64_state = ka.linear_attention(q.double(), k.double(), v.double(), est, **call64)
    with backends.mode("native", "on"):
        got, got_state = ka.linear_attention(q, k, v, est, **call)
    for part, a, b, c in zip(ref._fields, got, ref, ref64):
        _rounding_close(a, b, c, f"{what} {part}")
    for part in ("w", "z"):       # states at the eager log-scale
        shift = (got_state.log_scale - ref_state.log_scale).double()
        shift = shift.reshape(*shift.shape, *([1] * (getattr(got_state, part).dim() - shift.dim())))
        a = getattr(got_state, part).double() * torch.exp(shift)
        _rounding_close(a, getattr(ref_state, part), getattr(ref64_state, part), f"{what} state {part}")


@pytest.mark.parametrize("rule", ["sum", ka.rules.Decay(0.9)], ids=["sum", "decay"])
@pytest.mark.parametrize("chunk_size", [8, 7])
def test_kernel_equals_eager(kernel_only, rule, chunk_size):
    q, k, v = data(shape=(2, 3, 75, 8))          # 75 tokens: a partial last chunk for both chunk sizes
    for name in ("positive_orthogonal", "trig", "nystrom_uniform"):
        est = ka.make_estimator(name, num_features=16, rng=0).fit(q, k)
        _compare(q, k, v, est, f"{name} {rule} C={chunk_size}", rule=rule, chunk_size=chunk_size)
    # 2 x 3 sequences per call; FAVOR+ features computed inside the kernel
    assert kernel_only == [("causal, features inside", 6, 75), (6, 75, 16), (6, 75, 16)]


def test_padding_initial_state_and_outputs(kernel_only):
    q, k, v = data(shape=(2, 40, 6), seed=1)
    est = ka.make_estimator("positive", num_features=24, rng=1).fit(q, k)
    padding = torch.zeros(2, 40, dtype=torch.bool)
    padding[0, 30:] = True
    padding[1, 3:6] = True
    padding[1, 17] = True
    for rule in ("sum", ka.rules.Decay(0.8)):
        _compare(q, k, v, est, f"padding {rule}", rule=rule, chunk_size=8, key_padding_mask=padding)
        with backends.mode("native", "off"):
            _, state = ka.linear_attention(q[:, :13], k[:, :13], v[:, :13], est, causal=True, mode="chunked",
                                           rule=rule, chunk_size=8, return_state=True)
        _compare(q[:, 13:], k[:, 13:], v[:, 13:], est, f"carried state {rule}", rule=rule, chunk_size=8,
                 initial_state=state)
    with backends.mode("native", "off"):
        ref = ka.linear_attention(q, k, v, est, causal=True, mode="chunked", chunk_size=8)
    got = ka.linear_attention(q, k, v, est, causal=True, mode="chunked", chunk_size=8)   # outputs only
    _rounding_close(got, ref, ka.linear_attention(q.double(), k.double(), v.double(), est, causal=True,
                                                  mode="chunked", chunk_size=8), "outputs")
    assert len(kernel_only) >= 5


def test_two_threads_equal_one(kernel_only):
    q, k, v = data(shape=(5, 90, 8), seed=2)
    est = ka.make_estimator("positive", num_features=32, rng=2).fit(q, k)
    one = ka.linear_attention(q, k, v, est, causal=True, mode="chunked", chunk_size=16)
    torch.set_num_threads(2)                     # the conftest fixture restores the count
    two = ka.linear_attention(q, k, v, est, causal=True, mode="chunked", chunk_size=16)
    assert torch.equal(one, two)                 # each sequence runs on one thread: the same operations
    assert len(kernel_only) == 2


def test_used_exactly_when_eligible(kernel_only, monkeypatch):
    q, k, v = data(shape=(2, 40, 6), seed=3)
    est = ka.make_estimator("positive", num_features=8, rng=0).fit(q, k)
    run = dict(causal=True, mode="chunked", chunk_size=8)
    ka.linear_attention(q.double(), k.double(), v.double(), est, **run)      # float64: eager
    with backends.mode("backward", "off"):             # a gradient: the compiled backward (test_native_backward)
        ka.linear_attention(q.requires_grad_(), k, v, est, **run)
    ka.linear_attention(q.detach(), k, v, est, rule=ka.rules.Delta(), **run)  # another rule: eager
    with backends.mode("native", "off"):
        ka.linear_attention(q.detach(), k, v, est, **run)
    with backends.mode("native", "auto"):                                    # auto: below MIN_ENTRIES, eager
        ka.linear_attention(q.detach(), k, v, est, **run)
    torch.set_num_threads(3)                                                 # fewer sequences than threads
    ka.linear_attention(q.detach(), k, v, est, **run)
    torch.set_num_threads(1)
    assert kernel_only == []
    ka.linear_attention(q.detach(), k, v, est, **run)
    ka.linear_attention(q.detach(), k, v, ka.make_estimator("trig", num_features=8, rng=0).fit(q, k), **run)
    assert kernel_only == [("causal, features inside", 2, 40), (2, 40, 8)]
    monkeypatch.setattr(native, "MIN_ENTRIES", 2 * 40 * 8)
    with backends.mode("native", "auto"):                                    # auto at the threshold: the kernel
        ka.linear_attention(q.detach(), k, v, est, **run)
    assert len(kernel_only) == 3
    # the written-out backward (padded keys: the compiled backward declines them): its forward needs no gradient
    padded = torch.arange(40).expand(2, 40) >= 37
    with backends.mode("native", "auto"), backends.mode("backward", "on"), backends.record() as calls:
        ka.linear_attention(q.detach().requires_grad_(), k, v, est, key_padding_mask=padded, **run)
    assert [c.backend for c in calls if c.op == "linear_attention.gradient"] == ["chunk-backward"]
    assert kernel_only[-1] == (2, 40, 8)


# ------------------------------------------------------------------------------------------ non-causal kernel
def _exponential_maps():
    """Every registered map whose features the non-causal kernel computes itself (decided by its class)."""
    names = []
    for name in ka.available_estimators():
        try:
            est = ka.make_estimator(name, num_features=16, rng=0)
        except (TypeError, ValueError):
            continue
        if not est.capabilities().kind == "features":
            continue
        x = torch.randn(2, 24, 8, generator=torch.Generator().manual_seed(0))
        try:
            est.fit(x, x)
        except ValueError:                       # a map whose dimension is fixed by d: not of the form
            continue
        if est.exponential_form(x, "query") is not None:
            names.append(name)
    return names


EXPONENTIAL_MAPS = _exponential_maps()


def test_the_exponential_family_takes_the_noncausal_kernel():
    for name in ("positive", "positive_orthogonal", "hyperbolic", "gerf", "oprf", "sderf", "saderf", "aderf"):
        assert name in EXPONENTIAL_MAPS, name
    for name in ("trig", "nystrom_uniform", "hedgehog", "taylor2", "elu1", "exact"):
        assert name not in EXPONENTIAL_MAPS, name


@pytest.mark.parametrize("rule", ["sum", ka.rules.Decay(0.9)], ids=["sum", "decay"])
def test_noncausal_kernel_equals_eager_for_every_exponential_map(kernel_only, rule):
    q, k, v = data(shape=(2, 3, native.NONCAUSAL_BLOCK + 45, 8), seed=5)   # a partial second block
    for name in EXPONENTIAL_MAPS:
        est = ka.make_estimator(name, num_features=16, rng=0).fit(q, k)
        _compare(q, k, v, est, f"{name} {rule}", causal=False, rule=rule)
    assert kernel_only == [("non-causal", 6, native.NONCAUSAL_BLOCK + 45, native.NONCAUSAL_BLOCK + 45)] * len(
        EXPONENTIAL_MAPS)


@pytest.mark.parametrize("rule", ["sum", ka.rules.Decay(0.9)], ids=["sum", "decay"])
@pytest.mark.parametrize("chunk_size", [8, 7])
def test_causal_kernel_with_features_inside_equals_eager_for_every_exponential_map(kernel_only, rule, chunk_size):
    n = native.feature_block(chunk_size) + 45                  # two feature blocks, a partial last chunk
    q, k, v = data(shape=(2, 3, n, 8), seed=8)
    for name in EXPONENTIAL_MAPS:
        est = ka.make_estimator(name, num_features=16, rng=0).fit(q, k)
        _compare(q, k, v, est, f"{name} {rule} C={chunk_size}", rule=rule, chunk_size=chunk_size)
    assert kernel_only == [("causal, features inside", 6, n)] * len(EXPONENTIAL_MAPS)


def _padding_and_maps(q, k, tail):
    """Padded keys (a padded tail from ``tail`` in the first sequence, a few inside the second) and a map with
    ``eps``, one with per-feature offsets and one with input transforms."""
    padding = torch.zeros(q.shape[:2], dtype=torch.bool)
    padding[0, tail:] = True
    padding[1, 3:6] = True
    padding[1, 290] = True
    maps = {"positive eps": ka.make_estimator("positive", num_features=24, rng=1, eps=1e-3).fit(q, k),
            "gerf (offset)": ka.make_estimator("gerf", num_features=24, rng=1).fit(q, k),
            "aderf (transforms)": ka.make_estimator("aderf", num_features=24, rng=1).fit(q, k)}
    return padding, maps


def test_causal_features_inside_padding_state_eps_offset(kernel_only):
    q, k, v = data(shape=(2, 300, 6), seed=9)
    padding, maps = _padding_and_maps(q, k, tail=250)
    for what, est in maps.items():
        for rule in ("sum", ka.rules.Decay(0.8)):
            _compare(q, k, v, est, f"{what} padding {rule}", rule=rule, chunk_size=16, key_padding_mask=padding)
            with backends.mode("native", "off"):
                _, state = ka.linear_attention(q[:, :100], k[:, :100], v[:, :100], est, causal=True,
                                               mode="chunked", rule=rule, chunk_size=16, return_state=True)
            _compare(q[:, 100:], k[:, 100:], v[:, 100:], est, f"{what} carried state {rule}", rule=rule,
                     chunk_size=16, initial_state=state)
    assert sum(1 for c in kernel_only if c[0] == "causal, features inside") == 3 * 2 * 2


def test_noncausal_padding_state_eps_offset_and_cross_lengths(kernel_only):
    q, k, v = data(shape=(2, 300, 6), seed=6)
    padding, maps = _padding_and_maps(q, k, tail=200)
    for what, est in maps.items():
        for rule in ("sum", ka.rules.Decay(0.8)):
            _compare(q, k, v, est, f"{what} padding {rule}", causal=False, rule=rule, key_padding_mask=padding)
            with backends.mode("native", "off"):
                _, state = ka.linear_attention(q[:, :100], k[:, :100], v[:, :100], est, causal=False,
                                               mode="chunked", rule=rule, return_state=True)
            _compare(q, k[:, 100:170], v[:, 100:170], est, f"{what} carried state, 300 queries, 70 keys {rule}",
                     causal=False, rule=rule, initial_state=state)
    est = maps["positive eps"]
    with backends.mode("native", "off"):
        ref = ka.linear_attention(q, k, v, est, mode="chunked")
    got = ka.linear_attention(q, k, v, est, mode="chunked")                # outputs only
    _rounding_close(got, ref, ka.linear_attention(q.double(), k.double(), v.double(), est, mode="chunked"),
                    "outputs")
    q_strided = q.transpose(0, 1).contiguous().transpose(0, 1)             # batch stride < row stride
    v_shared = v[:, :1].expand_as(v)                                        # every key the same value row
    got = ka.linear_attention(q_strided, k, v_shared, est, mode="chunked")
    with backends.mode("native", "off"):
        ref = ka.linear_attention(q, k, v_shared.contiguous(), est, mode="chunked")
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert sum(1 for c in kernel_only if c[0] == "non-causal") == 3 * 2 * 2 + 2


def test_noncausal_two_threads_equal_one(kernel_only):
    q, k, v = data(shape=(5, 300, 8), seed=2)
    est = ka.make_estimator("positive", num_features=32, rng=2).fit(q, k)
    one = ka.linear_attention(q, k, v, est, mode="chunked")
    torch.set_num_threads(2)                     # the conftest fixture restores the count
    two = ka.linear_attention(q, k, v, est, mode="chunked")
    assert torch.equal(one, two)
    assert len(kernel_only) == 2


def test_noncausal_used_exactly_when_eligible(kernel_only, monkeypatch):
    q, k, v = data(shape=(2, 40, 6), seed=3)
    est = ka.make_estimator("positive", num_features=8, rng=0).fit(q, k)
    ka.linear_attention(q, k, v, ka.make_estimator("trig", num_features=8, rng=0).fit(q, k), mode="chunked")
    ka.linear_attention(q.double(), k.double(), v.double(), est, mode="chunked")     # float64: eager
    ka.linear_attention(q.requires_grad_(), k, v, est, mode="chunked")                # a gradient: eager
    ka.linear_attention(q.detach(), k, v, est, mode="chunked", rule=ka.rules.Delta())  # another rule: eager
    ka.linear_attention(q.detach(), k, v, est, mode="parallel")                        # another mode
    with backends.mode("native", "off"):
        ka.linear_attention(q.detach(), k, v, est, mode="chunked")
    with backends.mode("native", "auto"):                                                           # below MIN_ENTRIES
        ka.linear_attention(q.detach(), k, v, est, mode="chunked")
    torch.set_num_threads(3)                                                           # fewer sequences
    ka.linear_attention(q.detach(), k, v, est, mode="chunked")
    torch.set_num_threads(1)
    assert kernel_only == []
    ka.linear_attention(q.detach(), k, v, est, mode="chunked")
    assert kernel_only == [("non-causal", 2, 40, 40)]


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """No passed check and no failure before and after the test, builds in the private ``tmp_path`` (pytest makes it
    0700). A library loaded in this process stays loaded (its operators cannot be unregistered): tests of building
    and loading forget its path for their duration, so that the next load builds (or refuses) again."""
    monkeypatch.setenv(native.DIR_ENV, str(tmp_path / "native"))
    monkeypatch.setattr(native._State, "path", None)
    native.reset()
    yield tmp_path
    native.reset()


# A fresh process: its status after loading, and its threads (/proc/self/task) once torch's pool runs (a product
# and an exp on 2 threads) and again after the operators ran on 8 sequences.
_STATUS = """
import json, os, torch
from kernapprox.attention import native
torch.set_num_threads(2)
tasks = lambda: len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1
a = torch.randn(512, 512)
(a @ a).sum(), torch.exp(torch.randn(1 << 22)).sum()
ok, before = native._load(), tasks()
if ok:
    B, L, r, dv = 8, 1024, 64, 16
    pq, pk, lq, lk = torch.rand(B, L, r), torch.rand(B, L, r), torch.randn(B, L), torch.randn(B, L)
    state, c = torch.zeros(B, dv + 1, r), torch.full((B,), native.SENTINEL)
    out, den, logs = torch.empty(B, L, dv), torch.empty(B, L), torch.empty(B, L)
    native.chunk_block(pq, lq, pk, lk, torch.randn(B, L, dv), state, c, out, den, logs, 64, 0.0, False)
print(json.dumps([ok, native.status(), str(native.build_root()), before, tasks()]))
"""


@pytest.fixture(scope="module")
def fresh_process() -> list:
    import json

    done = subprocess.run([sys.executable, "-c", _STATUS], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_build_is_cached_private_and_reported(fresh_process):
    """A process loads the build of an earlier one (not rebuilt), from folders of mode 0700."""
    assert native._load(), native.status()
    status, root = native.status(), str(native.build_root())
    assert status.startswith("loaded "), status
    library = Path(status.removeprefix("loaded "))
    stamp = library.stat().st_mtime_ns
    for folder in (Path(root), library.parent):
        info = folder.lstat()
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700, folder
        assert info.st_uid == os.getuid()
    assert library.parent.parent == Path(root)
    ok, status_again = fresh_process[:2]
    assert ok and status_again == status and library.stat().st_mtime_ns == stamp     # loaded, not rebuilt


def _planted_library(folder: Path, name: str, marker: Path) -> Path:
    """A shared library whose constructor writes ``marker``: it would run the moment the library is loaded."""
    source = folder / "planted.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {\n'
                      f'    FILE* f = fopen("{marker}", "w"); if (f) {{ fputs("loaded", f); fclose(f); }}\n}}\n')
    target = folder / name
    done = subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(target)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"no C compiler to build the planted library: {done.stderr[:200]}")
    return target


def _plant_everywhere(tmp_path: Path, marker: Path, open_root: Path):
    """Libraries at the predictable names: the old per-user folder of the shared temporary directory and, in the
    world-writable ``open_root``, the build folder and file name the build would use."""
    old = Path(tempfile.gettempdir()) / f"kernapprox-{os.getuid()}"
    old.mkdir(exist_ok=True)
    planted = [_planted_library(old, "chunked-0123456789abcdef.so", marker)]
    for folder in (open_root, open_root / _digest()):
        folder.mkdir(exist_ok=True)
        os.chmod(folder, 0o777)
        planted.append(_planted_library(folder, "kernapprox_chunked.so", marker))
    return planted


def _digest() -> str:
    """The name of the build folder (the hash of source, flags and torch) :func:`native._build_dir` uses."""
    import hashlib

    return hashlib.sha256(native.SOURCE.read_bytes() + "\0".join(
        [*native._flags(), torch.__version__, os.environ.get("CXX", "")]).encode()).hexdigest()[:16]


def _refused(expected: str):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not native._load()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "disabled" in messages[0] and expected in messages[0], messages
    assert native.status().startswith("failed:")


def test_a_planted_library_is_never_loaded(fresh_kernel, monkeypatch):
    """A library planted at the predictable names in a world-writable folder of the shared temporary directory
    never runs: the override pointing there is refused (mode 0777), so is a cache root whose build folders are
    open to others, and an unwritable cache root has no fallback to the temporary directory."""
    tmp_path = fresh_kernel
    marker = tmp_path / "marker"
    shared = Path(tempfile.mkdtemp(prefix="kernapprox-planted-"))
    os.chmod(shared, 0o777)
    try:
        _plant_everywhere(tmp_path, marker, shared / "native")
        monkeypatch.setenv(native.DIR_ENV, str(shared / "native"))           # the override: a 0777 folder
        _refused("not private")
        native.reset()
        monkeypatch.delenv(native.DIR_ENV)
        monkeypatch.setenv("KERNAPPROX_CACHE_DIR", str(shared))              # the cache root: its native/ is 0777
        _refused("not private")
        native.reset()
        blocked = tmp_path / "file"
        blocked.write_text("")
        monkeypatch.setenv("KERNAPPROX_CACHE_DIR", str(blocked / "cache"))   # unwritable: no fallback anywhere
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert not native._load()
        assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
        private = tmp_path / "private"
        private.mkdir(mode=0o700)
        (private / _digest()).mkdir(mode=0o755)                              # a private root, an open build folder
        native.reset()
        monkeypatch.setenv(native.DIR_ENV, str(private))
        _refused("not private")
        assert not marker.exists(), "a planted library was loaded"
    finally:
        import shutil

        shutil.rmtree(shared, ignore_errors=True)


def _eager_fallback_check(monkeypatch, expected_reason):
    monkeypatch.setattr(fused, "use_fused", lambda *args, **kwargs: False)     # only the kernel differs
    q, k, v = data(shape=(2, 33, 6), seed=4)
    est = ka.make_estimator("positive", num_features=8, rng=0).fit(q, k)
    with backends.mode("native", "off"):
        ref = ka.linear_attention(q, k, v, est, causal=True, mode="chunked", chunk_size=8)
    with warnings.catch_warnings(record=True) as caught, backends.mode("native", "on"):
        warnings.simplefilter("always")
        first = ka.linear_attention(q, k, v, est, causal=True, mode="chunked", chunk_size=8)
        second = ka.linear_attention(q, k, v, est, causal=True, mode="chunked", chunk_size=8)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "chunked kernels are disabled" in messages[0], messages
    assert expected_reason in messages[0]
    assert torch.equal(first, ref) and torch.equal(second, ref)
    assert native.status().startswith("failed:") and expected_reason in native.status()


def test_failed_build_falls_back_to_eager_with_one_warning(fresh_kernel, monkeypatch):
    broken = fresh_kernel / "broken-c++"           # a "compiler" that tells its version and fails every build
    broken.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then exec c++ --version; fi\nexit 1\n')
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    _eager_fallback_check(monkeypatch, "Error building extension")


@pytest.fixture
def loaded_kernel():
    """The library loaded, its check to be run again by the test (and again after it)."""
    assert native._load(), native.status()
    native.reset()
    yield
    native.reset()


def test_wrong_kernel_is_caught_by_the_self_check(loaded_kernel, monkeypatch):
    real = native.chunk_block

    def wrong(pq, lq, pk, lk, v, state, c, out, den, logs, *rest, **kwargs):
        real(pq, lq, pk, lk, v, state, c, out, den, logs, *rest, **kwargs)
        out.mul_(1.001)                           # a kernel off by 0.1 %

    monkeypatch.setattr(native, "chunk_block", wrong)
    _eager_fallback_check(monkeypatch, "self-check: the causal operator's outputs differ")


def test_wrong_noncausal_kernel_is_caught_by_the_self_check(loaded_kernel, monkeypatch):
    real = native.noncausal

    def wrong(forms, v, padding, state, c, out, *rest, **kwargs):
        real(forms, v, padding, state, c, out, *rest, **kwargs)
        state.mul_(1.001)                         # a final state off by 0.1 %

    monkeypatch.setattr(native, "noncausal", wrong)
    _eager_fallback_check(monkeypatch, "self-check: the non-causal operator's state differ")


def test_the_self_check_reference_is_the_eager_code():
    """The self-check's float64 reference (native._reference, which imports nothing of linear.py) equals the eager
    parallel mode on a problem with decay, a carried state and padded keys; and its sentinel is the rules'."""
    from kernapprox.attention.linear import _normalized_parallel
    from kernapprox.rules import NormalizedState

    assert native.SENTINEL == SENTINEL
    gen = torch.Generator().manual_seed(11)
    batch, n_q, n_k, r, d_v, a = 2, 9, 7, 5, 3, -0.1
    for causal in (True, False):
        nq = n_k if causal else n_q
        pq, pk = torch.rand(batch, nq, r, generator=gen).double(), torch.rand(batch, n_k, r, generator=gen).double()
        lq, lk = torch.randn(batch, nq, generator=gen).double(), torch.randn(batch, n_k, generator=gen).double()
        lk[0, 2] = SENTINEL
        v = torch.randn(batch, n_k, d_v, generator=gen).double()
        w0, z0, c0 = (t.double() for t in native._random_state(gen, batch, r, d_v))
        out, den, log_den, s, log_s = native._reference(pq, lq, pk, lk, v, causal, a, (w0, z0, c0))
        num, den_p, logs_p, final = _normalized_parallel(pq, lq, pk, lk, v, causal, a, None,
                                                         NormalizedState(w0, z0, c0), True)
        torch.testing.assert_close(out, num / den_p[..., None])
        torch.testing.assert_close(den * torch.exp(log_den - logs_p), den_p)
        want = torch.cat([final.w, final.z[..., None]], -1).transpose(-1, -2)
        torch.testing.assert_close(s * torch.exp(log_s - final.log_scale)[:, None, None], want)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
def test_the_products_run_on_torchs_threads_only(fresh_process):
    """Each sequence runs on one of torch's threads with its products on that thread: in a fresh process whose
    pool of 2 threads runs, the operator on 8 sequences starts no thread (a multi-threaded BLAS call inside the
    parallel region would start a nested team)."""
    ok, status, _, before, after = fresh_process
    assert ok, status
    assert before > 0 and after == before, (before, after)


def test_exported_exp_matches_torch_and_checks_its_arguments():
    assert native._load(), native.status()
    src = torch.cat([-100 * torch.rand(10_000, generator=torch.Generator().manual_seed(0)),
                     torch.tensor([0.0, -87.0, -88.0, -1e30])])
    out = native.exp_nonpositive(src, torch.empty_like(src))
    ref = torch.exp(src.double())
    normal = ref >= torch.finfo(torch.float32).tiny
    rel = ((out.double() - ref).abs() / ref)[normal]
    assert float(rel.max()) < 4 * torch.finfo(torch.float32).eps
    assert torch.all(out[~normal] == 0)                      # below the smallest normal float: flushed to 0
    with pytest.raises(ValueError, match="src must be"):
        native.exp_nonpositive(src.double(), torch.empty_like(src))
    with pytest.raises(ValueError, match="differ in size"):
        native.exp_nonpositive(src, torch.empty(3))
