"""The small dense linear algebra of the fits (``r × r`` eigendecompositions and solves) on one BLAS thread.

numpy's OpenBLAS keeps its worker threads spinning for a while after a multithreaded call. On a machine with as
many cores as torch has threads, those spinning workers take the cores from torch's next call: measured on the
2-core machine, ``nystrom_uniform`` features of 16384 points at ``r = 256`` took 60–120 ms right after a fit whose
``256 × 256`` ``eigh`` ran on numpy's two threads, and 33–39 ms after the same fit on one thread (which itself
went from 9–31 ms to 6–8 ms). A problem this small gains nothing from a second thread, so the fits run it on one
(:func:`one_blas_thread`); numpy's thread count is restored on exit.
"""

from __future__ import annotations

import functools


@functools.cache
def _controller():
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()


def one_blas_thread():
    """Context manager: numpy's (and scipy's, when loaded) BLAS pools limited to one thread inside the block
    (threadpoolctl, a controller built once per process: entering costs microseconds)."""
    return _controller().limit(limits=1, user_api="blas")
