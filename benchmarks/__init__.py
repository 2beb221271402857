"""Performance benchmarks: ``python -m benchmarks.run`` (``make bench``) measures kernapprox side by side with
torch SDPA, performer-pytorch and scikit-learn and stores the table as ``results/bench.nc``;
``benchmarks/gpu_check.sh`` runs them, with the large experiment presets, on a CUDA machine."""
