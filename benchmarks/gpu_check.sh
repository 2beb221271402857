#!/usr/bin/env bash
# Performance checks on a CUDA machine: the benchmarks, and the `full` presets of attention_error and modes
# (plus modes' `gpu` preset, n up to 512k, and trained_icl's `gpu` preset, the Zoology-like widths and lengths).
# Writes everything under $OUT (default results/gpu) and prints the benchmark table.
# Run from anywhere: bash benchmarks/gpu_check.sh
#   OUT=dir       where datasets, figures and logs go
#   PY=python     the interpreter (default .venv/bin/python, created by `make install` if missing)
#   SKIP_ERROR=1  skip attention_error (the slowest part when only timings are wanted)
#   SKIP_TRAINED=1  skip trained_icl's gpu preset (it trains 26 models)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-results/gpu}
mkdir -p "$OUT"

if [ ! -x "$PY" ]; then make install; fi
# performer-pytorch is the optional `bench` extra; without it that comparison is reported as skipped
"$PY" -m pip install --quiet -e ".[bench]" || echo "performer-pytorch could not be installed: comparison skipped"

"$PY" - <<'EOF' | tee "$OUT/device.txt"
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch: this script is for a GPU machine")
p = torch.cuda.get_device_properties(0)
print(f"device: {p.name}, {p.total_memory / 2**30:.0f} GiB, torch {torch.__version__}, CUDA {torch.version.cuda}")
print(f"TF32 defaults: matmul {torch.backends.cuda.matmul.allow_tf32}, cudnn {torch.backends.cudnn.allow_tf32}, "
      f"float32 matmul precision {torch.get_float32_matmul_precision()}")
EOF
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv \
    | tee -a "$OUT/device.txt" || true

echo "== benchmarks (CUDA, float32; TF32 as the defaults above; fused feature maps: Triton kernels)"
# every case, the 'machine' ceilings and the 'fusion' case (eager vs fused feature maps, Triton compile times) included
"$PY" -m benchmarks.run --device cuda --fused large --out "$OUT/bench.nc" 2>&1 | tee "$OUT/bench.txt"
echo "== the same attention cases with the eager feature maps (what fusion changes on this GPU)"
"$PY" -m benchmarks.run --device cuda --fused off --cases machine chunked_vs_sdpa flop_rate \
    --out "$OUT/bench_eager.nc" 2>&1 | tee "$OUT/bench_eager.txt"

echo "== modes: full preset (n = 1k..64k), then gpu preset (n = 1k..512k)"
"$PY" -m experiments.modes --preset full --device cuda --out "$OUT/modes_full.nc" --figure "$OUT/modes_full.png" \
    2>&1 | tee "$OUT/modes_full.txt"
"$PY" -m experiments.modes --preset gpu --device cuda --out "$OUT/modes_gpu.nc" --figure "$OUT/modes_gpu.png" \
    2>&1 | tee "$OUT/modes_gpu.txt"
"$PY" - "$OUT/modes_full.nc" "$OUT/modes_gpu.nc" <<'EOF' | tee -a "$OUT/modes_gpu.txt"
import sys
from experiments.modes import summarise
from kernapprox.sweep import load
for path in sys.argv[1:]:
    print(path, {k: round(v, 3) if isinstance(v, float) else v for k, v in summarise(load(path)).items()})
EOF

if [ "${SKIP_ERROR:-0}" != "1" ]; then
    echo "== attention_error: full preset"
    "$PY" -m experiments.attention_error --preset full --device cuda --out "$OUT/attention_error_full.nc" \
        --figure "$OUT/attention_error_full.png" 2>&1 | tee "$OUT/attention_error_full.txt"
fi
if [ "${SKIP_TRAINED:-0}" != "1" ]; then
    echo "== trained_icl: gpu preset (Zoology-like widths and lengths)"
    "$PY" -m experiments.trained_icl --preset gpu --device cuda --out "$OUT/trained_icl_gpu.nc" \
        --figure "$OUT/trained_icl_gpu.png" 2>&1 | tee "$OUT/trained_icl_gpu.txt"
fi
echo "done: $OUT"
