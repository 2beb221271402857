"""A tiny numpy-only comparative study for the engine's tests: an estimator axis, paired data, a reference
computed once per data draw, a fixed parameter, summaries and findings."""


from kernapprox import stats
from kernapprox.plotting import bullets, fmt_ci
from kernapprox.sweep import Experiment, Metric, Parameter, Reference, run_cli

GRIDS = {
    "smoke": {"estimator": ["a", "b"], "num_features": [1, 2], "scale": [1.0, 2.0], "seed": [0, 1, 2]},
    "full": {"estimator": ["a", "b", "c"], "num_features": [1, 2, 4], "scale": [1.0, 2.0, 4.0], "seed": [0, 1]},
}
METRICS = {
    "data_mean": Metric(long_name="mean of the cell's data", units="1", description="mean of the shared draws"),
    "error": Metric(long_name="an error", units="1", description="|estimate − data mean|"),
}
REFERENCE_METRICS = {
    "reference_mean": Metric(long_name="mean of the data, once per draw", units="1", description="the same draws"),
}
PARAMETERS = {"size": Parameter(6, long_name="draws per data set", units="1")}
REFERENCE_CALLS: list = []


def _data(params, data_rng):
    return params["scale"] * data_rng.standard_normal(params["size"])


def run_cell(params, rng, device, data_rng):
    x = _data(params, data_rng)
    estimate = x.mean() + rng.standard_normal() / params["num_features"]
    return {"data_mean": x.mean(), "error": abs(estimate - x.mean())}


def run_reference(params, device, data_rng):
    REFERENCE_CALLS.append(dict(params))
    return {"reference_mean": _data(params, data_rng).mean()}


def summarise(ds):
    summary = stats.summarise(ds["error"], "seed")
    summary.attrs["description"] = "summary of error over seed"
    ds["error_summary"] = summary
    return ds


def findings(ds):
    s = ds["error_summary"].sel(estimator="a", num_features=2, scale=1.0)
    return bullets([f"Median error of a at r = 2: {fmt_ci(s)}."])


def plot(ds, path):
    from kernapprox import plotting

    fig, ax = plotting.new_figure()
    plotting.plot_summary(ax, ds["error_summary"].sel(estimator="a", scale=1.0), "num_features", label="a")
    plotting.save_figure(fig, path, "Toy paired study: median error over seeds with its 95 % interval.")


EXPERIMENT = Experiment(name="toy_paired", title="Toy paired study", description="Engine tests of paired studies.",
                        grids=GRIDS, metrics=METRICS, run_cell=run_cell, plot=plot,
                        data_axes=("scale", "seed"), reference=Reference(run_cell=run_reference,
                                                                        metrics=REFERENCE_METRICS),
                        parameters=PARAMETERS, summarise=summarise, findings=findings)

if __name__ == "__main__":
    run_cli(EXPERIMENT)
