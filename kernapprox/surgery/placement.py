"""Placements of exact layers in a model whose other layers run on an estimator, and the search over them.

A *placement* is the sorted tuple of the layers that keep exact attention (``()``: every layer substituted).
:func:`walk_placements` visits every placement of a ``num_layers``-layer model (or a bounded set of them) as a
depth-first walk of the layer-by-layer choice tree, sharing the hidden states of common prefixes: for six layers,
2 + 4 + … + 64 = 126 layer evaluations instead of 6 · 64 = 384, fewer still because an all-exact prefix is the
exact model's, which is known. :func:`placement_bytes` counts the attention memory of a placement.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import numpy as np
import torch

__all__ = ["first_layers", "last_layers", "placement_label", "all_placements", "hybrid_placements",
           "check_layers", "walk_placements", "placement_bytes"]


def _check_count(count, num_layers: int) -> int:
    if isinstance(count, bool) or not isinstance(count, int | np.integer) or not 0 <= count <= num_layers:
        raise ValueError(f"count must be an int in [0, {num_layers}], got {count!r}")
    return int(count)


def check_layers(layers: Iterable[int], name: str, num_layers: int) -> set[int]:
    """``layers`` as a set of layer indices in ``[0, num_layers)``, else ``ValueError`` naming ``name``."""
    out = set()
    for layer in layers:
        if isinstance(layer, bool) or not isinstance(layer, int | np.integer) or not 0 <= layer < num_layers:
            raise ValueError(f"{name} must hold layer indices in [0, {num_layers}), got {layer!r}")
        out.add(int(layer))
    return out


def first_layers(count: int, num_layers: int) -> list[int]:
    """Layers ``0 … count−1``."""
    return list(range(_check_count(count, num_layers)))


def last_layers(count: int, num_layers: int) -> list[int]:
    """The last ``count`` layers."""
    return list(range(num_layers - _check_count(count, num_layers), num_layers))


def placement_label(exact_layers: Iterable[int], num_layers: int) -> str:
    """``"E:0,5"`` for exact attention in layers 0 and 5 (``"E:-"``: none exact)."""
    layers = sorted(check_layers(exact_layers, "exact_layers", num_layers))
    return "E:" + (",".join(map(str, layers)) if layers else "-")


def all_placements(num_layers: int) -> list[tuple[int, ...]]:
    """Every subset of layers (as the sorted tuple of layers that keep exact attention), by size then order."""
    return [c for size in range(num_layers + 1) for c in itertools.combinations(range(num_layers), size)]


def hybrid_placements(max_exact: int, num_layers: int) -> list[tuple[int, ...]]:
    """The placements a bounded hybrid search visits, in :func:`all_placements` order: every subset of at most
    ``max_exact`` exact layers, every single substituted layer (all others exact: each layer's own sensitivity),
    and the naive placements (the first ``k`` and the last ``k`` layers exact, every ``k``)."""
    max_exact = _check_count(max_exact, num_layers)
    naive = ({tuple(first_layers(k, num_layers)) for k in range(num_layers + 1)}
             | {tuple(last_layers(k, num_layers)) for k in range(num_layers + 1)})
    return [p for p in all_placements(num_layers) if len(p) <= max_exact or len(p) >= num_layers - 1 or p in naive]


def walk_placements(num_layers: int, start, step: Callable, visit: Callable, *, exact_states,
                    placements: Iterable[Iterable[int]] | None = None) -> None:
    """Visit every placement of exact layers (or the given ``placements``), sharing common prefixes.

    Parameters
    ----------
    num_layers : int
    start
        The hidden states entering layer 0.
    step : callable
        ``step(layer, hidden, substituted) -> (hidden, error)``: one layer, exact (``substituted=False``) or on the
        estimator; ``error`` is what the caller records for a substituted layer (``None`` for an exact one).
    visit : callable
        ``visit(exact_layers, hidden, errors, states)`` once per placement, in the walk's order: the final hidden
        states, ``{layer: error}`` of its substituted layers and every layer's output states.
    exact_states : sequence
        The exact model's output states per layer: an all-exact prefix needs no evaluation.
    placements : iterables of layer indices, optional
        Only the prefixes leading to one of them are evaluated, and each is visited once.
    """
    prefixes = None
    if placements is not None:
        chosen = [check_layers(p, "placements", num_layers) for p in placements]
        if not chosen:
            raise ValueError("placements must name at least one placement (None: all of them)")
        prefixes = {tuple(layer in p for layer in range(depth)) for p in chosen for depth in range(num_layers + 1)}

    def walk(layer, hidden, exact_layers, errors, states):
        if layer == num_layers:
            visit(tuple(exact_layers), hidden, errors, states)
            return
        for keep_exact in (True, False):
            if prefixes is not None and tuple(j in exact_layers for j in range(layer)) + (keep_exact,) not in prefixes:
                continue
            if keep_exact:
                nxt, err = exact_states[layer], None     # the exact prefix needs no recomputation
                if exact_layers != list(range(layer)):
                    nxt, err = step(layer, hidden, False)
            else:
                nxt, err = step(layer, hidden, True)
            new_errors = dict(errors) if err is None else {**errors, layer: err}
            walk(layer + 1, nxt, exact_layers + [layer] if keep_exact else exact_layers, new_errors, states + [nxt])

    walk(0, start, [], {}, [])


def placement_bytes(estimator, exact_layers: Iterable[int], seq_lens, *, num_layers: int, num_heads: int,
                    head_dim: int, d_v: int | None = None, dtype: torch.dtype = torch.float32) -> np.ndarray:
    """Bytes of attention memory per text: exact layers keep their KV cache, ``n · (d + d_v)`` numbers per head at
    the text's length ``n``; substituted layers the fitted ``estimator``'s ``state_bytes`` per head (the linear
    state, and what it declares as context-dependent). Returns one number per entry of ``seq_lens``."""
    exact_set = check_layers(exact_layers, "exact_layers", num_layers)
    d_v = head_dim if d_v is None else d_v
    seq_lens = np.asarray(seq_lens, dtype=np.int64)
    per_exact = seq_lens * (head_dim + d_v) * torch.empty((), dtype=dtype).element_size() * num_heads
    total = per_exact * len(exact_set)
    approx = num_layers - len(exact_set)
    if approx:
        if estimator is None:
            raise ValueError("an estimator (substitution) is required when a layer is not exact")
        per_text = np.array([estimator.state_bytes(d_v, dtype, seq_len=int(n)) for n in seq_lens])
        total = total + approx * num_heads * per_text
    return total
