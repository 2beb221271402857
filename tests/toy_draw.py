"""toy_paired with its data drawn by the engine (``Experiment.draw``): every cell and the reference of a draw get
the same ``data``; each computation of a draw leaves a file in ``$TOY_DRAW_LOG`` (when set), so tests can count
how often each draw was made, across processes."""

import os
import uuid

import numpy as np
import toy_paired

from kernapprox.sweep import Experiment, Reference, run_cli


def draw(params, data_rng, device):
    log = os.environ.get("TOY_DRAW_LOG")
    if log:
        name = f"{params['scale']}-{params['seed']}-{uuid.uuid4().hex}"
        open(os.path.join(log, name), "w").close()
    return {"x": toy_paired._data(params, data_rng)}


def run_cell(params, rng, device, data):            # no data_rng: the draw has spent the data stream
    x = data["x"]
    estimate = x.mean() + rng.standard_normal() / params["num_features"]
    return {"data_mean": x.mean(), "error": abs(estimate - x.mean())}


def run_reference(params, device, data_rng, data):  # a function that names data_rng is still handed it
    if not isinstance(data_rng, np.random.Generator):
        raise TypeError(f"data_rng is a {type(data_rng).__name__}")
    return {"reference_mean": data["x"].mean()}


EXPERIMENT = Experiment(name="toy_draw", title="Toy study with engine draws", description="Engine tests of draws.",
                        grids=toy_paired.GRIDS, metrics=toy_paired.METRICS, run_cell=run_cell, plot=toy_paired.plot,
                        data_axes=("scale", "seed"), parameters=toy_paired.PARAMETERS, draw=draw,
                        reference=Reference(run_cell=run_reference, metrics=toy_paired.REFERENCE_METRICS),
                        summarise=toy_paired.summarise, findings=toy_paired.findings)

if __name__ == "__main__":
    run_cli(EXPERIMENT)
