"""Token blocks of the chunked mode: how many tokens' features are computed at once (shared by every rule)."""

from __future__ import annotations

import torch

# Token blocks of the chunked mode hold about this many feature entries (all batch entries together). On a CPU a
# block's features stay in cache and the allocator recycles its temporaries; whole-sequence feature matrices of
# hundreds of MB made every element-wise pass a round trip to memory (and a fresh page-faulted allocation).
# A GPU wants large blocks for parallelism. Results do not depend on the block length beyond rounding.
_FEATURES_PER_BLOCK = {"cpu": 1 << 19, "cuda": 1 << 26}


def chunked_block_length(batch: int, r: int, chunk_size: int, n: int, device: torch.device) -> int:
    """Tokens per block of the chunked mode for ``batch`` sequences of ``n`` tokens and ``r`` features.

    A multiple of ``chunk_size`` holding about ``_FEATURES_PER_BLOCK[device.type]`` feature entries (all batch
    entries together), and never more than the sequence rounded up to a whole chunk. Memory accounts of the
    chunked mode (e.g. the ``modes`` experiment) use it to know what one block holds.
    """
    target = _FEATURES_PER_BLOCK.get(device.type, _FEATURES_PER_BLOCK["cuda"])
    chunks = max(1, target // max(1, batch * r * chunk_size))
    return min(chunks * chunk_size, -(-n // chunk_size) * chunk_size)
