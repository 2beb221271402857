"""``python -m benchmarks.refit_copy_task``: what the refit policy of :class:`kernapprox.nn.KernelAttention` does
for a data-dependent map in training, on a copy task.

Task: ``[a_1..a_M, SEP, a_1..a_M]`` with ``a_i`` uniform over ``V`` tokens; the model predicts the second half
from the first (next-token cross-entropy on those ``M`` positions; chance: loss ``log V``, accuracy ``1/V``).
Model: token + learned position embeddings, one causal ``KernelAttention`` layer (``E = 32``, 2 heads) with a
residual, a linear read-out; Adam (lr 3e-3), batches of 64, every draw from fixed seeds (torch's global RNG is not
used by the layer; Adam is deterministic). Compared: exact attention; ``nystrom_uniform`` at ``r = 16`` fitted once
on the first batch (the behaviour before the policy, now with a warning); the same map with ``refit_every=1``.
Reported per seed: the mean training loss of the last 50 steps, the accuracy on 512 held-out sequences (eval mode),
and the share of rows with a non-positive normaliser on them (:func:`kernapprox.metrics.nonpositive_normalizer_rate`;
Nyström's normaliser is signed). CPU, seconds to minutes; not a timing.
"""

from __future__ import annotations

import argparse
import math
import warnings

import numpy as np
import torch
from torch import nn

import kernapprox as ka
from kernapprox.metrics import nonpositive_normalizer_rate
from kernapprox.nn import KernelAttention

V, M, E, H = 8, 8, 32, 2
N = 2 * M + 1


class CopyModel(nn.Module):
    def __init__(self, estimator: str, num_features, refit_every, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.tok = nn.Parameter(torch.randn(V + 1, E, generator=g) * 0.5)
        self.pos = nn.Parameter(torch.randn(N, E, generator=g) * 0.5)
        self.attn = KernelAttention(E, H, estimator, num_features=num_features, causal=True, rng=seed,
                                    refit_every=refit_every)
        self.out = nn.Parameter(torch.randn(E, V, generator=g) * E**-0.5)

    def embed(self, x):
        return self.tok[x] + self.pos

    def forward(self, x):
        h = self.embed(x)
        return (h + self.attn(h)) @ self.out


def batch(rng: np.random.Generator, size: int):
    """Inputs ``(size, N)`` (the sequence shifted by one, SEP first in the second half) and targets."""
    a = rng.integers(0, V, size=(size, M))
    seq = np.concatenate([a, np.full((size, 1), V), a], 1)
    inputs = np.concatenate([seq[:, :-1], np.full((size, 1), V)], 1)
    return torch.from_numpy(inputs), torch.from_numpy(seq[:, 1:])


def run(estimator: str, num_features, refit_every, seed: int, steps: int) -> dict:
    model = CopyModel(estimator, num_features, refit_every, seed)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    rng = np.random.default_rng(seed)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)                 # the fitted-once map warns, by design
        for _ in range(steps):
            x, y = batch(rng, 64)
            logits = model(x)[:, M:2 * M]
            loss = nn.functional.cross_entropy(logits.reshape(-1, V), y[:, M:2 * M].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss))
        model.eval()
        x, y = batch(np.random.default_rng(10_000 + seed), 512)
        with torch.no_grad():
            acc = float((model(x)[:, M:2 * M].argmax(-1) == y[:, M:2 * M]).double().mean())
            rate = float("nan")
            if ka.capabilities(estimator).kind == "features":
                q, k, v = model.attn._project(model.embed(x), None, None)
                parts = ka.linear_attention(q, k, v, model.attn.estimator, True, return_parts=True)
                rate = float(nonpositive_normalizer_rate(parts.normalizer).mean())
    return {"loss": float(np.mean(losses[-50:])), "accuracy": acc, "nonpositive": rate}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.refit_copy_task", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"copy task V={V} M={M}: chance loss {math.log(V):.3f}, chance accuracy {1 / V:.3f}; {args.steps} steps")
    for label, name, r, refit in (("exact", "exact", None, None),
                                  ("nystrom_uniform r=16, fitted once", "nystrom_uniform", 16, None),
                                  ("nystrom_uniform r=16, refit_every=1", "nystrom_uniform", 16, 1)):
        rows = [run(name, r, refit, seed, args.steps) for seed in range(args.seeds)]
        print(f"{label:<38} loss {_column(rows, 'loss', 2)}   accuracy {_column(rows, 'accuracy', 3)}   "
              f"non-positive normalisers {_column(rows, 'nonpositive', 2)}", flush=True)


def _column(rows, key, digits):
    return " / ".join(f"{row[key]:.{digits}f}" for row in rows)


if __name__ == "__main__":
    main()
