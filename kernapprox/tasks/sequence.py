"""Next-step prediction of a real sequence, one task per modality: text bytes, log-mel audio, video patches.

The state-size question of the modality spectrum (does a continuous, redundant modality compress into a smaller
attention state than text?) needs models trained on each modality's own data. :class:`NextStep` is that task for
:mod:`kernapprox.models.training`: a window of ``L + 1`` consecutive steps of one source, the model reads the
first ``L`` and predicts each next one,

.. math::
    \\mathcal L = \\frac{1}{L}\\sum_{t=1}^{L} \\ell(f(x_{1..t}), x_{t+1}),

with ``ℓ`` the cross-entropy for token sources (text as UTF-8 bytes, vocabulary 256) and the squared error per
dimension for frame sources (standardised frames, so a loss of 1 is predicting the mean). For frames the model's
output is the *change* of the frame, ``x̂_{t+1} = x_t + f(x_{1..t})`` (a residual read-out, as in predictive
coding of audio): persistence is then the zero function, so a short training run starts from the strongest
trivial predictor instead of having to learn the identity through the network. This is the
autoregressive objective of GPT-style language models (Radford et al. 2018) applied unchanged to audio frames
(e.g. van den Oord et al. 2016, WaveNet, for samples; here log-mel frames) and to video patches in raster order
(ViT patches, Dosovitskiy et al. 2021; autoregressive as in Chen et al. 2020, *Generative Pretraining from
Pixels*).

Sources (:data:`SEQUENCE_SOURCES`): ``text`` (Shakespeare's works, :func:`kernapprox.lm.text_documents`, as bytes),
``music`` (:func:`kernapprox.signals.audio_frames` of ``vibe_ace``), ``speech`` (the same log-mel frames of
``librivox_austen``: 24.7 s of one LibriVox reader), ``video`` and ``video_cuts``
(:func:`kernapprox.signals.video_frames` of ``bigbuckbunny`` and ``bikes``, 8×8 grey patches) and two synthetic
references: ``gp_l8`` (a stationary Gaussian process with squared-exponential covariance of length 8 steps, 16
independent channels), smooth and continuous, and ``zipf_markov`` (:func:`zipf_markov_tokens`: 256 tokens, each
drawn from a Zipf law over a permutation of the vocabulary that the previous token picks), discrete with purely
local structure. Each source is split once by position: the first ``1 − eval_fraction`` of its steps train,
the rest evaluate (:func:`kernapprox.signals.window_starts`' convention), so no evaluation window shares a step
with a training window. Training windows start uniformly at random in the training block; evaluation windows
are fixed and disjoint (:meth:`NextStep.eval_windows`).

The trivial baselines are part of the task (:meth:`NextStep.baseline_losses`): for tokens the unigram
distribution of the training block (add-one smoothed); for frames the training block's mean frame and the
previous frame (persistence), so that a model's loss is read against what needs no context at all.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from ..validation import check_choice, check_positive_int

__all__ = ["NextStep", "NextStepBatch", "SEQUENCE_SOURCES", "SequenceData", "load_sequence", "gp_trajectory",
           "zipf_markov_tokens",
           "unavailable_reason"]


class SequenceData(NamedTuple):
    """A whole source: ``values`` ``(T,)`` int64 tokens or ``(T, D)`` float64 frames, ``kind`` (``"tokens"`` or
    ``"frames"``), ``modality`` (text, audio, video, synthetic), ``vocab_size`` (tokens) and ``attrs``
    (provenance: strings and numbers)."""

    values: np.ndarray
    kind: str
    modality: str
    vocab_size: int | None
    attrs: dict


def gp_trajectory(length: int, channels: int, length_scale: float, seed: int = 0) -> np.ndarray:
    """``(length, channels)`` draws of a stationary Gaussian process with covariance
    ``k(τ) = exp(−τ²/(2ℓ²))`` on the integers, by spectral filtering of white noise: the FFT of a white sequence
    times ``sqrt(S(f))``, ``S(f) ∝ exp(−2π²ℓ²f²)`` (the covariance's Fourier transform; Rasmussen & Williams 2006,
    eq. 4.9), inverted. Circular over a 2× padded period, so the kept half has no wrap-around correlation above
    ``exp(−length²/(2ℓ²))``. Standardised per channel."""
    check_positive_int(length, "length")
    check_positive_int(channels, "channels")
    if not np.isfinite(length_scale) or length_scale <= 0:
        raise ValueError(f"length_scale must be positive, got {length_scale}")
    period = 2 * length
    white = np.random.default_rng(seed).standard_normal((period, channels))
    freqs = np.fft.rfftfreq(period)
    filt = np.exp(-np.pi ** 2 * length_scale ** 2 * freqs ** 2)[:, None]             # sqrt(S(f))
    x = np.fft.irfft(np.fft.rfft(white, axis=0) * filt, n=period, axis=0)[:length]
    return (x - x.mean(0)) / x.std(0)


def zipf_markov_tokens(length: int, vocab_size: int = 256, exponent: float = 1.0, seed: int = 0) -> np.ndarray:
    r"""``(length,)`` int64 tokens of a first-order Markov chain whose every transition law is Zipf's:

    .. math::
        P(x_{t+1} = π_{x_t}(k) \mid x_t) = \frac{k^{-a}}{\sum_{j=1}^{V} j^{-a}},\qquad k = 1, …, V,

    with ``π_v`` a random permutation of the ``V`` tokens for each previous token ``v`` (seeded) and ``a`` the
    exponent (Zipf 1949's law of ranks; a Markov source of order one, Shannon 1948, §3). Discrete, heavy-tailed and
    purely local: the previous token fixes the law of the next, so the best predictor reads one step back and the
    unigram law (the trivial predictor) ignores what it could gain, ``H(unigram) − H(Zipf_a)`` nats per token. The
    chain starts from a Zipf draw of the identity ranks."""
    check_positive_int(length, "length")
    check_positive_int(vocab_size, "vocab_size")
    if not np.isfinite(exponent) or exponent <= 0:
        raise ValueError(f"exponent must be positive, got {exponent}")
    gen = np.random.default_rng(seed)
    law = np.arange(1, vocab_size + 1, dtype=np.float64) ** -exponent
    law /= law.sum()
    successor = np.stack([gen.permutation(vocab_size) for _ in range(vocab_size)])   # [previous, rank] -> token
    ranks = gen.choice(vocab_size, size=length, p=law)
    out = np.empty(length, dtype=np.int64)
    out[0] = ranks[0]
    for t in range(1, length):
        out[t] = successor[out[t - 1], ranks[t]]
    return out


def _zipf_markov() -> SequenceData:
    values = zipf_markov_tokens(131072)
    return SequenceData(values, "tokens", "synthetic", 256,
                        {"source": "zipf_markov_tokens", "length": 131072, "vocab_size": 256, "exponent": 1.0,
                         "seed": 0})


def _text() -> SequenceData:
    from .. import lm

    docs = lm.text_documents("shakespeare")
    data = "\n\n".join(body for _, body in docs).encode("utf-8")
    values = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    return SequenceData(values, "tokens", "text", 256, {"source": "shakespeare", "tokens": "UTF-8 bytes",
                                                       "sha256": hashlib.sha256(data).hexdigest()})


def _audio(name: str) -> Callable[[], SequenceData]:
    def load() -> SequenceData:
        from .. import signals

        frames = signals.audio_frames(name)
        return SequenceData(frames.values, "frames", "audio", None, _flat(frames.attrs))
    return load


def _video(name: str) -> Callable[[], SequenceData]:
    def load() -> SequenceData:
        from .. import signals

        frames = signals.video_frames(name)
        return SequenceData(frames.values, "frames", "video", None, _flat(frames.attrs))
    return load


def _gp() -> SequenceData:
    values = gp_trajectory(32768, 16, 8.0, seed=0)
    return SequenceData(values, "frames", "synthetic", None,
                        {"source": "gp_trajectory", "length": 32768, "channels": 16, "length_scale": 8.0, "seed": 0})


def _flat(attrs: dict) -> dict:
    return {k: v if isinstance(v, str | int | float) else repr(v) for k, v in attrs.items()}


def unavailable_reason(source: str) -> str | None:
    """``None`` when ``source`` loads here, else what is missing and how to install it (cheap: nothing is
    decoded)."""
    check_choice(source, "source", tuple(SEQUENCE_SOURCES))
    if source == "text":
        from .. import lm
        return lm.text_unavailable_reason("shakespeare")
    if source in _SIGNAL_OF:
        from .. import signals
        return signals.available(_SIGNAL_OF[source])
    return None


_SIGNAL_OF = {"music": "vibe_ace", "speech": "librivox_austen", "video": "bigbuckbunny", "video_cuts": "bikes"}

SEQUENCE_SOURCES: dict[str, tuple[str, Callable[[], SequenceData]]] = {
    "text": ("text", _text),
    "music": ("audio", _audio("vibe_ace")),
    "speech": ("audio", _audio("librivox_austen")),
    "video": ("video", _video("bigbuckbunny")),
    "video_cuts": ("video", _video("bikes")),
    "gp_l8": ("synthetic", _gp),
    "zipf_markov": ("synthetic", _zipf_markov),
}
"""Source name → (modality, loader). Loaders raise ``ImportError``/``SignalUnavailableError`` naming the install
step where their files are missing."""


@functools.lru_cache(maxsize=8)
def load_sequence(source: str) -> SequenceData:
    """The whole of ``source`` (memoised per process); ``attrs["data_sha256"]`` hashes the values themselves."""
    check_choice(source, "source", tuple(SEQUENCE_SOURCES))
    data = SEQUENCE_SOURCES[source][1]()
    values = np.ascontiguousarray(data.values)
    if data.kind == "frames" and (values.ndim != 2 or not np.isfinite(values).all()):
        raise ValueError(f"source {source!r} gave frames of shape {values.shape} with non-finite values")
    digest = hashlib.sha256(values.tobytes()).hexdigest()[:24]
    return data._replace(values=values, attrs={**data.attrs, "data_sha256": digest, "steps": int(values.shape[0])})


class NextStepBatch(NamedTuple):
    """``inputs`` ``(B, L)`` int64 or ``(B, L, D)`` float32 (what the model reads); ``targets`` the next step of
    each input, same shape (int64 or float64); ``previous`` the input itself as float64 (frames; for the
    persistence baseline)."""

    inputs: torch.Tensor
    targets: torch.Tensor


@dataclasses.dataclass(frozen=True)
class NextStep:
    """Next-step prediction of one source (see the module docstring).

    Parameters
    ----------
    source : str
        A key of :data:`SEQUENCE_SOURCES`.
    seq_len : int
        ``L``, the steps a prompt reads.
    eval_fraction : float
        Trailing share of the source held out for evaluation.
    """

    source: str = "text"
    seq_len: int = 256
    eval_fraction: float = 0.25
    name: ClassVar[str] = "next_step"
    score_name: ClassVar[str] = "loss"
    higher_is_better: ClassVar[bool] = False

    def __post_init__(self):
        check_choice(self.source, "source", tuple(SEQUENCE_SOURCES))
        check_positive_int(self.seq_len, "seq_len")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")

    # ------------------------------------------------------------------------------------ configuration
    @property
    def data(self) -> SequenceData:
        return load_sequence(self.source)

    @property
    def modality(self) -> str:
        return SEQUENCE_SOURCES[self.source][0]

    @property
    def model_io(self) -> dict:
        """Tokens: an embedding of the 256 bytes and 256 logits; frames: a linear read-in and read-out of ``D``."""
        data = self.data
        if data.kind == "tokens":
            return {"vocab_size": data.vocab_size, "input_dim": None, "output_dim": data.vocab_size}
        dim = int(data.values.shape[1])
        return {"vocab_size": None, "input_dim": dim, "output_dim": dim}

    @property
    def difficulty(self) -> int:
        """The prompt length (no curriculum varies it)."""
        return self.seq_len

    def with_difficulty(self, seq_len: int) -> NextStep:
        return dataclasses.replace(self, seq_len=seq_len)

    def evaluation(self) -> NextStep:
        """The held-out task of a training curve (windows from the evaluation block, see :meth:`sample`)."""
        return _HeldOut(self.source, self.seq_len, self.eval_fraction)

    def to_dict(self) -> dict:
        return {"name": self.name, "source": self.source, "seq_len": self.seq_len,
                "eval_fraction": self.eval_fraction, "data_sha256": self.data.attrs["data_sha256"]}

    # --------------------------------------------------------------------------------------------- data
    def _block(self, split: str) -> tuple[int, int]:
        steps = self.data.values.shape[0]
        cut = int(round(steps * (1 - self.eval_fraction)))
        lo, hi = (0, cut) if split == "train" else (cut, steps)
        if hi - lo < self.seq_len + 1:
            raise ValueError(f"the {split} block of {self.source!r} holds {hi - lo} steps, fewer than seq_len + 1 = "
                             f"{self.seq_len + 1}")
        return lo, hi

    def _batch(self, starts, device) -> NextStepBatch:
        values = self.data.values
        idx = np.asarray(starts)[:, None] + np.arange(self.seq_len + 1)
        w = values[idx]
        if self.data.kind == "tokens":
            t = torch.as_tensor(w, device=device)
            return NextStepBatch(t[:, :-1], t[:, 1:])
        t = torch.as_tensor(w, device=device)
        return NextStepBatch(t[:, :-1].float(), t[:, 1:])

    def sample(self, gen: np.random.Generator, batch: int, device=None) -> NextStepBatch:
        """``batch`` windows starting uniformly at random in the training block."""
        check_positive_int(batch, "batch")
        lo, hi = self._block("train")
        return self._batch(gen.integers(lo, hi - self.seq_len, size=batch), device)

    def eval_windows(self, count: int, device=None) -> NextStepBatch:
        """``count`` fixed, disjoint windows spread evenly over the evaluation block (``ValueError`` when they do
        not fit)."""
        from ..signals import window_starts

        check_positive_int(count, "count")
        starts = window_starts(self.data.values.shape[0], self.seq_len + 1, count, "eval",
                               eval_fraction=self.eval_fraction)
        return self._batch(starts, device)

    # ------------------------------------------------------------------------------------------ scoring
    def predictions(self, outputs: torch.Tensor, batch: NextStepBatch) -> torch.Tensor:
        """Logits (tokens) or the predicted next frames ``inputs + outputs`` (frames: a residual read-out)."""
        if self.data.kind == "tokens":
            return outputs
        return batch.inputs.to(outputs.dtype) + outputs

    def position_losses(self, outputs: torch.Tensor, batch: NextStepBatch) -> torch.Tensor:
        """``(B, L)`` float64 loss of every prediction: cross-entropy (nats) or squared error per dimension."""
        if self.data.kind == "tokens":
            logp = torch.log_softmax(outputs.double(), dim=-1)
            return -logp.gather(-1, batch.targets.unsqueeze(-1)).squeeze(-1)
        return (self.predictions(outputs.double(), batch) - batch.targets.double()).pow(2).mean(-1)

    def loss(self, outputs: torch.Tensor, batch: NextStepBatch) -> torch.Tensor:
        """Mean next-step loss (float32 for training)."""
        if self.data.kind == "tokens":
            return torch.nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]).float(),
                                                     batch.targets.reshape(-1))
        return (self.predictions(outputs.float(), batch) - batch.targets.float()).pow(2).mean()

    def score(self, outputs: torch.Tensor, batch: NextStepBatch) -> torch.Tensor:
        """Per-window mean loss ``(B,)`` float64."""
        return self.position_losses(outputs, batch).mean(-1)

    def baseline_losses(self, batch: NextStepBatch) -> dict[str, torch.Tensor]:
        """``(B, L)`` float64 losses of the trivial predictors on ``batch`` (see the module docstring):
        ``unigram`` for tokens; ``mean`` and ``previous`` for frames."""
        lo, hi = self._block("train")
        train = self.data.values[lo:hi]
        if self.data.kind == "tokens":
            counts = np.bincount(train, minlength=self.data.vocab_size).astype(np.float64) + 1.0
            logp = torch.as_tensor(np.log(counts / counts.sum()), device=batch.targets.device)
            return {"unigram": -logp[batch.targets]}
        mean = torch.as_tensor(train.mean(0), device=batch.targets.device)
        targets = batch.targets.double()
        return {"mean": (targets - mean).pow(2).mean(-1),
                "previous": (targets - batch.inputs.double()).pow(2).mean(-1)}


@dataclasses.dataclass(frozen=True)
class _HeldOut(NextStep):
    """The evaluation view of a :class:`NextStep`: :meth:`sample` draws windows from the evaluation block."""

    def sample(self, gen: np.random.Generator, batch: int, device=None) -> NextStepBatch:
        check_positive_int(batch, "batch")
        lo, hi = self._block("eval")
        return self._batch(gen.integers(lo, hi - self.seq_len, size=batch), device)
