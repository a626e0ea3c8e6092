#!/usr/bin/env bash
# The one command for the lent GPU: GPU tests, unit tests and `pinpool bench`, in one call.
# Every log goes to $LOGS and comes back packed as $OUT/raw.tgz (the device tool returns at
# most 8 files); bench.txt and summary.txt come back as they are. The short summary prints last.
#   bash tests/bench/run_on_device.sh [extra pinpool-bench flags]
# PINPOOL_SOAK=1 adds the soak; a carried .old/ (git archive of an earlier commit) adds the
# regression check that the stream tests fail there; PINPOOL_DIAG="copy_latency" adds diagnostics.
set -uo pipefail
source "$(dirname "$0")/setup_device.sh"
export PYTHONUNBUFFERED=1
{
  date -u +"%Y-%m-%dT%H:%MZ"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
} | tee "$LOGS/device.txt"
# Each phase has its own time box (PINPOOL_BOX_SCALE stretches them) so that one slow phase
# cannot eat the device tool's 10-minute call and lose the logs of the others.
box() { timeout "$(( $1 * ${PINPOOL_BOX_SCALE:-1} ))" "${@:2}"; }
box "${PINPOOL_GPU_BOX:-200}" python3 -m pytest ${PINPOOL_GPU_TESTS:-tests/gpu} -q -p no:cacheprovider -rs --durations=8 2>&1 | tee "$LOGS/gpu_tests.log" | tail -25
gpu_rc=${PIPESTATUS[0]}
old_rc=skipped
if [ -d .old/pinpool ] && [ -n "${PINPOOL_OLD_STREAMS:-}" ]; then
  # The stream regression tests against a carried tree from before the stream fixes (not
  # 3e5dd9f, which has them): each must fail there.
  cp tests/gpu/test_streams_cuda.py .old/old_test_streams.py
  (cd .old && timeout 60 python3 -m pytest -q -p no:cacheprovider -c /dev/null --rootdir=. old_test_streams.py \
    -k "case1 or case2 or case3") >"$LOGS/old_code_streams.log" 2>&1
  old_rc=$?
  # The earlier code's own per-site breakdown, with its direct-cudart and torch rows (the A/B).
  if [ -f .old/tests/gpu/decode_breakdown.py ]; then
    (cd .old && PYTHONPATH=".:${PYTHONPATH:-}" timeout 60 python3 tests/gpu/decode_breakdown.py) >"$LOGS/old_code_breakdown.txt" 2>&1
  fi
fi
gate_line=skipped
if [ -n "${PINPOOL_GATE:-}" ] && [ -d .old/pinpool ]; then
  # The small core's speed gate: the same workloads on the carried earlier tree, then on this one.
  gw=${PINPOOL_GATE_WORKLOADS:-staging,zero_copy,decode,sampling_sglang,memcache_sglang}
  # old, new, new, old: the order cancels a drift between a machine's first and later runs.
  # PINPOOL_GATE_ORDER="old1 new1 old2 new2 old3 new3" runs more pairs (run i of each tree is a pair).
  olds=() news=()
  # PINPOOL_GATE_CPUS pins every run to the same CPUs ("auto": the first four the GPU's PCI
  # device calls local and this process may use; device.txt says where they came from).
  pin=()
  if [ -n "${PINPOOL_GATE_CPUS:-}" ]; then
    cpus=$PINPOOL_GATE_CPUS
    if [ "$cpus" = auto ]; then
      bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader -i 0 | head -1 | tr 'A-F' 'a-f')
      cpus=$(python3 tests/bench/speed_gate.py cpus "/sys/bus/pci/devices/${bus#0000}/local_cpulist" 4 2>>"$LOGS/device.txt")
    fi
    pin=(taskset -c "$cpus")
    { echo "gate runs pinned to CPUs $cpus"; lscpu | grep -i numa; } | tee -a "$LOGS/device.txt"
  fi
  for run in ${PINPOOL_GATE_ORDER:-old1 new1 new2 old2}; do
    tree=.; [[ $run == old* ]] && tree=.old
    box "${PINPOOL_GATE_BOX:-150}" ${pin[@]+"${pin[@]}"} python3 tests/bench/speed_gate.py run --tree "$tree" --workloads "$gw" \
      --json "$LOGS/gate_$run.json" >"$LOGS/gate_$run.txt" 2>&1
    if [[ $run == old* ]]; then olds+=("$LOGS/gate_$run.json"); else news+=("$LOGS/gate_$run.json"); fi
  done
  old_list=$(IFS=,; echo "${olds[*]}") new_list=$(IFS=,; echo "${news[*]}")
  python3 tests/bench/speed_gate.py compare "$old_list" "$new_list" | tee "$OUT/gate.txt" | tail -3
  # Against a peer measured in the same process (a machine's runs drift apart by up to 1.8x).
  python3 tests/bench/speed_gate.py compare "$old_list" "$new_list" --normalise >"$OUT/gate_normalised.txt" 2>&1
  # Each tree's best run per figure: a run the machine disturbed is only ever slower.
  python3 tests/bench/speed_gate.py compare "$old_list" "$new_list" --best >"$OUT/gate_best.txt" 2>&1
  # Run i of each tree against the other's run i, normalised, the median over the pairs.
  python3 tests/bench/speed_gate.py compare "$old_list" "$new_list" --paired --normalise >"$OUT/gate_paired.txt" 2>&1
  gate_line="$(grep -h '^GATE' "$OUT/gate.txt") | normalised: $(grep -h '^GATE' "$OUT/gate_normalised.txt") | best: $(grep -h '^GATE' "$OUT/gate_best.txt") | paired: $(grep -h '^GATE' "$OUT/gate_paired.txt")"
fi
serve_rc=skipped
# PINPOOL_SERVE_RUNS="GPU-bound:light:512:240 host-bound:medium:384:120": each serve table in a
# process and box of its own (config:load:requests:seconds), so one slow load cannot lose the
# tables of the others (the CLI prints its tables at the end); each prints as it finishes.
for run in ${PINPOOL_SERVE_RUNS:-}; do
  IFS=: read -r cfg load n secs <<<"$run"
  PINPOOL_SERVE_CONFIGS=$cfg PINPOOL_SERVE_LOADS=$load PINPOOL_SERVE_REQUESTS=$n box "$secs" python3 -m pinpool.bench.cli \
    bench --workloads serve --repeats "${PINPOOL_SERVE_ROUNDS:-5}" --json "$LOGS/serve_${cfg}_${load}.json" \
    2>"$LOGS/serve_${cfg}_${load}.err" | tee -a "$OUT/serve.txt" | grep -v '^note' | tail -8
  rc=${PIPESTATUS[0]}
  echo "serve $cfg $load: rc=$rc"
  serve_rc=$(( ${serve_rc/skipped/0} || rc ))
done
if [ -n "${PINPOOL_SERVE:-}" ]; then
  # The serve workload (request churn, every peer's staging) and its soak, boxed apart.
  box "${PINPOOL_SERVE_BOX:-300}" python3 -m pinpool.bench.cli bench --workloads serve --repeats 3 --json "$LOGS/serve.json" \
    2>"$LOGS/serve.err" | tee "$OUT/serve.txt" | tail -40
  serve_rc=${PIPESTATUS[0]}
  if [ -n "${PINPOOL_SERVE_SOAK:-}" ]; then
    box "${PINPOOL_SERVE_SOAK_BOX:-150}" python3 tests/bench/serve_soak.py ${PINPOOL_SERVE_SOAK} --json "$LOGS/serve_soak.json" 2>&1 | tee "$LOGS/serve_soak.txt" | tail -8
    serve_rc=$(( serve_rc || PIPESTATUS[0] ))
  fi
fi
bench_start=$SECONDS
# --plot only where matplotlib is installed: without it the bench refuses to start.
plot=(); python3 -c "import matplotlib" 2>/dev/null && plot=(--plot "$OUT/bench.png")
# PINPOOL_WORKLOADS narrows the eager bench; PINPOOL_GRAPH=0 and PINPOOL_UNIT=0 leave out the
# graph-decode bench and the interpreted unit tests (CI runs those) when a call must stay short.
eager_workloads=${PINPOOL_WORKLOADS:-staging,zero_copy,sampling,sampling_sglang,memcache,memcache_sglang,decode}
# 5 interleaved rounds, as the graph bench below: the eager decode loop's staging rows are
# tens of µs, and between machines of one kind a median of 3 moved by 10-15%.
bench_rc=0
if [ "$eager_workloads" != none ]; then
  box 240 python3 -m pinpool.bench.cli bench --workloads "$eager_workloads" --repeats 5 --json "$LOGS/bench.json" "${plot[@]}" "$@" \
    2>"$LOGS/bench.err" | tee "$OUT/bench.txt"
  bench_rc=${PIPESTATUS[0]}
fi
# The graph-decode workload in a box of its own (it captures graphs per config and mode),
# over 5 interleaved rounds: its host-bound rows are tens of µs, where one noisy round of 3
# moved a median (the 21:14 run's 16-running row: 57-113 µs).
graph_rc=0
if [ "${PINPOOL_GRAPH:-1}" != 0 ]; then
  box 200 python3 -m pinpool.bench.cli bench --workloads decode_graph --repeats 5 --json "$LOGS/bench_graph.json" "$@" \
    2>"$LOGS/bench_graph.err" | tee "$OUT/bench_graph.txt"
  graph_rc=${PIPESTATUS[0]}
fi
bench_rc=$(( bench_rc || graph_rc ))
bench_seconds=$((SECONDS - bench_start))
soak_rc=skipped
if [ -n "${PINPOOL_SOAK:-}" ]; then
  # PINPOOL_SOAK_ARGS, e.g. "--decode-steps 2000", shortens a soak for a quick re-check.
  box 60 python3 tests/bench/soak.py --json "$LOGS/soak.json" ${PINPOOL_SOAK_ARGS:-} 2>&1 | tee "$LOGS/soak.txt" | tail -5
  soak_rc=${PIPESTATUS[0]}
fi
two_rc=skipped
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  box 60 torchrun --nproc-per-node 2 -m pinpool.bench.engine.distributed 2>&1 | tee "$LOGS/two_gpu.txt" | tail -3
  two_rc=${PIPESTATUS[0]}
fi
# Where a decode step's staging time goes, per site and mode (diagnostic; ~15 s).
[ "${PINPOOL_BREAKDOWN:-1}" != 0 ] && box 45 python3 tests/bench/decode_breakdown.py >"$LOGS/breakdown.txt" 2>&1
if [ -n "${PINPOOL_PROFILE:-}" ]; then python3 tests/bench/profile_hot_paths.py >"$LOGS/profile.txt" 2>&1; fi
for diag in ${PINPOOL_DIAG:-}; do
  echo "== $diag"
  python3 "tests/bench/$diag.py" 2>&1 | tee "$LOGS/$diag.txt"
done
# Unit tests run the Triton kernels through the interpreter on CPU tensors, as CI does, but
# with this machine's triton: last, since CI runs them too.
unit_rc=0
echo "skipped (PINPOOL_UNIT=0)" >"$LOGS/unit_tests.log"
if [ "${PINPOOL_UNIT:-1}" != 0 ]; then
  TRITON_INTERPRET=1 box 180 python3 -m pytest tests/unit -q -p no:cacheprovider 2>&1 | tee "$LOGS/unit_tests.log" | tail -2
  unit_rc=${PIPESTATUS[0]}
fi
old_line=skipped
if [ "$old_rc" != skipped ]; then
  old_line="rc=$old_rc  $(grep -cE '^FAILED' "$LOGS/old_code_streams.log") failed there, $(grep -cE 'passed' "$LOGS/old_code_streams.log") passing lines (each must fail)"
fi
{
  echo
  echo "== summary ($(head -1 "$LOGS/device.txt"), $(sed -n 2p "$LOGS/device.txt"))"
  echo "gpu tests : rc=$gpu_rc  $(tail -1 "$LOGS/gpu_tests.log")"
  echo "unit tests: rc=$unit_rc  $(tail -1 "$LOGS/unit_tests.log")"
  echo "old code  : $old_line"
  echo "speed gate: $gate_line"
  echo "serve     : rc=$serve_rc"
  echo "bench     : rc=$bench_rc  ${bench_seconds} s (tables in bench.txt and bench_graph.txt; JSON in raw.tgz)"
  echo "soak      : rc=$soak_rc  $(grep -h '^SOAK' "$LOGS/soak.txt" 2>/dev/null)"
  echo "two GPUs  : rc=$two_rc  $(grep -h 'TWO-GPU CHECK' "$LOGS/two_gpu.txt" 2>/dev/null)"
} | tee "$OUT/summary.txt"
tar czf "$OUT/raw.tgz" -C "$LOGS" .
[ "$soak_rc" = skipped ] && soak_rc=0
[ "$serve_rc" = skipped ] && serve_rc=0
[ "$two_rc" = skipped ] && two_rc=0
exit $(( gpu_rc || unit_rc || bench_rc || soak_rc || two_rc || serve_rc ))
