"""A one-cell experiment that records the BLAS thread limit its cell runs under (engine test of ``threads``)."""

import numpy as np
from threadpoolctl import threadpool_info

from kernapprox.sweep import Experiment, Metric


def blas_threads() -> float:
    """The largest thread count of the BLAS libraries loaded in this process (NaN if none is found)."""
    counts = [info["num_threads"] for info in threadpool_info() if info.get("user_api") == "blas"]
    return float(max(counts)) if counts else np.nan


def run_cell(params, rng, device):
    return {"blas_threads": blas_threads()}


EXPERIMENT = Experiment(
    name="toy_threads", title="Toy threads", description="Engine tests: the BLAS thread limit inside a cell.",
    grids={"smoke": {"seed": [0]}}, run_cell=run_cell, plot=lambda ds, path: None,
    metrics={"blas_threads": Metric(long_name="BLAS threads", units="1", description="threadpoolctl's count")})
