#!/usr/bin/env bash
# The one command for the lent GPU: GPU tests, unit tests and `pinpool bench`, in one call.
# Logs go to $OUT (the device tool brings them back); the short summary table prints last.
#   bash tests/bench/run_on_device.sh [extra pinpool-bench flags]
set -uo pipefail
source "$(dirname "$0")/setup_device.sh"
export PYTHONUNBUFFERED=1
{
  date -u +"%Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
} | tee "$OUT/device.txt"
python3 -m pytest tests/gpu -q -p no:cacheprovider -rs --durations=8 2>&1 | tee "$OUT/gpu_tests.log"
gpu_rc=${PIPESTATUS[0]}
# Unit tests run the Triton kernels through the interpreter on CPU tensors, as CI does.
TRITON_INTERPRET=1 python3 -m pytest tests/unit -q -p no:cacheprovider 2>&1 | tee "$OUT/unit_tests.log" | tail -2
unit_rc=${PIPESTATUS[0]}
bench_start=$SECONDS
# --plot only where matplotlib is installed: without it the bench refuses to start.
plot=(); python3 -c "import matplotlib" 2>/dev/null && plot=(--plot "$OUT/bench.png")
python3 -m pinpool.bench.cli bench --json "$OUT/bench.json" "${plot[@]}" "$@" 2>"$OUT/bench.err" | tee "$OUT/bench.txt"
bench_rc=${PIPESTATUS[0]}
bench_seconds=$((SECONDS - bench_start))
soak_rc=skipped
if [ -n "${PINPOOL_SOAK:-}" ]; then
  # PINPOOL_SOAK_ARGS, e.g. "--decode-steps 2000", shortens a soak for a quick re-check.
  python3 tests/bench/soak.py --json "$OUT/soak.json" ${PINPOOL_SOAK_ARGS:-} 2>&1 | tee "$OUT/soak.txt"
  soak_rc=${PIPESTATUS[0]}
fi
two_rc=skipped
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  torchrun --nproc-per-node 2 -m engine.distributed 2>&1 | tee "$OUT/two_gpu.txt"
  two_rc=${PIPESTATUS[0]}
fi
# Where a decode step's staging time goes, per site and mode (diagnostic; ~15 s).
python3 tests/bench/decode_breakdown.py >"$OUT/breakdown.txt" 2>&1
if [ -n "${PINPOOL_PROFILE:-}" ]; then python3 tests/bench/profile_hot_paths.py >"$OUT/profile.txt" 2>&1; fi
# PINPOOL_DIAG="copy_latency": more diagnostics from tests/bench, printed here.
for diag in ${PINPOOL_DIAG:-}; do
  echo "== $diag"
  python3 "tests/bench/$diag.py" 2>&1 | tee "$OUT/$diag.txt"
done
echo
echo "== summary ($(head -1 "$OUT/device.txt"), $(sed -n 2p "$OUT/device.txt"))"
echo "gpu tests : rc=$gpu_rc  $(tail -1 "$OUT/gpu_tests.log")"
echo "unit tests: rc=$unit_rc  $(tail -1 "$OUT/unit_tests.log")"
echo "bench     : rc=$bench_rc  ${bench_seconds} s (tables above; JSON in bench.json, plot in bench.png)"
echo "soak      : rc=$soak_rc  $(grep -h '^SOAK' "$OUT/soak.txt" 2>/dev/null)"
echo "two GPUs  : rc=$two_rc  $(grep -h 'TWO-GPU CHECK' "$OUT/two_gpu.txt" 2>/dev/null)"
[ "$soak_rc" = skipped ] && soak_rc=0
[ "$two_rc" = skipped ] && two_rc=0
exit $(( gpu_rc || unit_rc || bench_rc || soak_rc || two_rc ))
