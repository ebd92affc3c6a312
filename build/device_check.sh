#!/usr/bin/env bash
# One GPU run that cannot be wasted: build, PTX self-test, a short correctness pass, the
# benchmark, compute-sanitizer; in that order of priority, within one time budget.
#
#   OUT=/some/dir bash build/device_check.sh            # on the GPU machine, from any directory
#   bash build/device_check.sh --dry-run                # on a CPU machine: the same logic, emulated
#   bash build/device_check.sh --plan                   # print the steps and their caps, run nothing
#
# Written for an H100 or H200 (sm_90, jax 0.11.2, Python 3.12, nvcc 13.0, no package index:
# everything must already be installed) and one 9-minute run. Steps, each with its own time cap:
#   machine       GPU, driver, nvcc, Python and jax versions (into device_check.json)
#   build         the extension in place, for this GPU's architecture only (nvidia-smi's
#                 compute capability, e.g. JAX_FLASH_CUDA_ARCHS=90-real)
#   ptx_selftest  build/ptx_selftest.cu: every wrapper of cuda/kernels/ptx.h on the real
#                 instruction against the emulation, lane by lane (and a check that it covers
#                 every wrapper)
#   correctness   tests/internals/test_gpu.py (-m gpu): a subset of the shared suite at full size,
#                 forward, backward, deterministic mode; plain runner if pytest is missing
#   bench         python -m jax_flash.bench at T=S=8k, H=128/64, causal or not, fwd and fwd+bwd:
#                 jax.nn (xla), jax.nn cuDNN, JAX's Pallas mha, cuda, pallas (Triton), pallas-mosaic
#                 (pallas_backend=mosaic_gpu, sm_90); then cuda again
#                 under JAX_FLASH_CUDA_LAYOUT=warp32 (cells "cuda:warp32" in bench.json), so
#                 that one run measures both warp layouts of the kernels; between the two, one
#                 decode cell (python -m jax_flash.bench --decode, B=8, S=32k: jax.nn, cuDNN,
#                 cuda on a contiguous and a paged cache; K/V bandwidth against the H200's
#                 nominal), under "decode" in bench.json
#   mosaic        build/mosaic_check.py: the pallas Mosaic GPU forward (pallas/_mosaic.py) against
#                 jax_flash.reference at 1k, then its speed at 8k beside cuDNN, JAX's attention_mgpu and cuda; then
#                 jax_flash.attention(implementation="pallas", pallas_backend="mosaic_gpu") against
#                 the reference (gradients, a NaN in v); then the features beyond the band (a query
#                 offset, lengths, a soft cap, segment ids, Hv != H), out and gradients
#   profile       Nsight Compute (ncu) on build/profile_case.py (H=128, 8k, bf16): speed of light,
#                 occupancy and warp stall reasons of the plain forward and backward kernels'
#                 launches (the general kernels launched beside them exit at once)
#   memcheck      compute-sanitizer --tool memcheck on build/sanitizer_case.py (tiny)
#   racecheck     compute-sanitizer --tool racecheck on the same
# The caps sum to the budget (DEVICE_CHECK_BUDGET_S, default 540 s; each cap scales with it),
# which the script asserts before it starts. Time a step leaves unused goes to the next
# elastic step (correctness, bench); no step can take time from the steps after it.
#
# Nothing is lost when the run is killed: each step's output goes to $OUT/<step>.log as it is
# written (and to stdout), $OUT/device_check.json is rewritten at every change of state
# (the step running, each result), bench.json after every benchmark case. A failing step does
# not stop the next ones; the steps that need the build are skipped when it failed. At most 8
# files are written under $OUT: device_check.json, bench.json and six step logs (the machine's
# and the profile's and mosaic step's text go into device_check.json).
#
# Results per step: ran (information only), passed, failed, cut (its time cap ran out),
# skipped (not applicable here, not selected, or its prerequisite failed). The table printed
# last says which, with seconds. Exit status 0 when no step failed or was cut.
#
# Environment: OUT (default ./device_out), DEVICE_CHECK_BUDGET_S, DEVICE_CHECK_CAP_<step>
# (seconds, replaces the scaled cap), DEVICE_CHECK_STEPS (comma list; others but machine skipped),
# DEVICE_CHECK_DRY_RUN=1 (= --dry-run), DEVICE_CHECK_COMMIT (recorded; default git's),
# DEVICE_CHECK_BENCH_ARGS (replaces the benchmark's size arguments), PYTHON, JAX_FLASH_CUDA_ARCHS.
# DEVICE_CHECK_CMD_<step> replaces a step's command by a shell snippet (tests of the script).
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2

usage() { sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

DRY=${DEVICE_CHECK_DRY_RUN:-0}
PLAN_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --plan) PLAN_ONLY=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "device_check: unknown argument $arg" >&2; usage >&2; exit 2 ;;
  esac
done

now_ms() { date +%s%3N; }
START_MS=$(now_ms)

# ---- the plan: steps in priority order, caps in seconds at the default budget --------------------
DEFAULT_BUDGET=540
BUDGET=${DEVICE_CHECK_BUDGET_S:-$DEFAULT_BUDGET}
STEPS=(machine build ptx_selftest correctness bench mosaic profile memcheck racecheck)
declare -A BASE_CAP=([machine]=10 [build]=100 [ptx_selftest]=45 [correctness]=90 [bench]=85 [mosaic]=60
  [profile]=60 [memcheck]=45 [racecheck]=45)
declare -A ELASTIC=([correctness]=1 [bench]=1)
declare -A NEEDS_BUILD=([correctness]=1 [bench]=1 [profile]=1 [memcheck]=1 [racecheck]=1)
declare -A CAP=()

if ! [[ $BUDGET =~ ^[0-9]+$ ]] || ((BUDGET < 1)); then
  echo "device_check: DEVICE_CHECK_BUDGET_S must be a positive number of seconds, got '$BUDGET'" >&2
  exit 2
fi
base_total=0
total=0
for s in "${STEPS[@]}"; do
  base_total=$((base_total + BASE_CAP[$s]))
  override_var=DEVICE_CHECK_CAP_$s
  scaled=$((BASE_CAP[$s] * BUDGET / DEFAULT_BUDGET))
  CAP[$s]=${!override_var:-$((scaled > 0 ? scaled : 1))}
  if ! [[ ${CAP[$s]} =~ ^[0-9]+$ ]]; then
    echo "device_check: $override_var must be a number of seconds, got '${CAP[$s]}'" >&2
    exit 2
  fi
  total=$((total + CAP[$s]))
done

print_plan() {
  echo "plan: budget ${BUDGET} s, dry run: $([ "$DRY" = 1 ] && echo yes || echo no)"
  local i=0 s
  for s in "${STEPS[@]}"; do
    i=$((i + 1))
    printf '  %d %-13s %4d s%s\n' "$i" "$s" "${CAP[$s]}" "${ELASTIC[$s]:+  + time unused by earlier steps}"
  done
  echo "total of caps: ${total} s of budget ${BUDGET} s"
}
# By construction: the base caps sum to the default budget and scale down with it.
((base_total == DEFAULT_BUDGET)) || { echo "device_check: base caps sum to $base_total, not $DEFAULT_BUDGET" >&2; exit 2; }
if ((total > BUDGET)); then
  print_plan >&2
  echo "device_check: the caps sum to ${total} s, over the budget of ${BUDGET} s: nothing was run" >&2
  exit 2
fi
if ((PLAN_ONLY)); then
  print_plan
  exit 0
fi

# ---- the environment -----------------------------------------------------------------------------
OUT=${OUT:-$REPO/device_out}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
for s in "${STEPS[@]}"; do rm -f "$OUT/$s.log"; done  # this run's files only, no stale ones
rm -f "$OUT"/device_check.json "$OUT"/device_check.json.tmp "$OUT"/bench.json "$OUT"/bench.json.tmp
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PY=${PYTHON:-$(command -v python3 || command -v python)}
[ -d /usr/local/cuda/bin ] && PATH=$PATH:/usr/local/cuda/bin
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PATH
if [ "$DRY" = 1 ]; then
  export JAX_FLASH_EMULATE_CUDA=1 JAX_PLATFORMS=cpu
fi
COMMIT=${DEVICE_CHECK_COMMIT:-$(timeout 5 git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
if [ "$COMMIT" != unknown ] && [ -z "${DEVICE_CHECK_COMMIT:-}" ] && ! timeout 10 git diff --quiet HEAD -- 2>/dev/null; then
  COMMIT="$COMMIT+uncommitted changes"
fi
STARTED=$(date -u +%Y-%m-%dT%H:%M:%SZ)
SELECTED=",${DEVICE_CHECK_STEPS:-$(IFS=,; echo "${STEPS[*]}")},"

declare -A STATE=() SECS=() LIMIT=() RC=() NOTE=()
for s in "${STEPS[@]}"; do STATE[$s]=pending; SECS[$s]=0; LIMIT[$s]=0; RC[$s]=""; NOTE[$s]=""; done
MACHINE_TEXT=""
PROFILE_TEXT=""
MOSAIC_TEXT=""
GPU_NAME=""
CC=""

json_str() {
  local s=$1
  s=${s//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\t'/ }
  s=${s//$'\r'/}
  s=${s//$'\n'/\\n}
  printf '"%s"' "$(printf '%s' "$s" | tr -d '\000-\037')"
}

elapsed_s() { echo $((($(now_ms) - START_MS) / 1000)); }

overall() {  # passed, failed or running
  local s bad=0
  for s in "${STEPS[@]}"; do
    case ${STATE[$s]} in pending | running) echo running; return ;; failed | cut) bad=1 ;; esac
  done
  ((bad)) && echo failed || echo passed
}

write_json() {  # rewritten whole at every change, renamed into place
  local s first=1 tmp="$OUT/device_check.json.tmp"
  {
    printf '{\n "tool": "build/device_check.sh",\n "dry_run": %s,\n' "$([ "$DRY" = 1 ] && echo true || echo false)"
    printf ' "commit": %s,\n "started": "%s",\n "budget_s": %d,\n "elapsed_s": %d,\n "result": "%s",\n' \
      "$(json_str "$COMMIT")" "$STARTED" "$BUDGET" "$(elapsed_s)" "$(overall)"
    printf ' "machine": {"gpu": %s, "compute_capability": %s, "archs": %s, "text": %s},\n' \
      "$(json_str "$GPU_NAME")" "$(json_str "$CC")" "$(json_str "${JAX_FLASH_CUDA_ARCHS:-}")" "$(json_str "$MACHINE_TEXT")"
    printf ' "profile": %s,\n' "$(json_str "$PROFILE_TEXT")"
    printf ' "mosaic": %s,\n' "$(json_str "$MOSAIC_TEXT")"
    printf ' "steps": ['
    for s in "${STEPS[@]}"; do
      ((first)) || printf ','
      first=0
      printf '\n  {"step": "%s", "state": "%s", "seconds": %d, "cap_s": %d, "limit_s": %d, "elastic": %s, "rc": %s, "note": %s, "log": %s}' \
        "$s" "${STATE[$s]}" "${SECS[$s]}" "${CAP[$s]}" "${LIMIT[$s]}" "$([ -n "${ELASTIC[$s]:-}" ] && echo true || echo false)" \
        "${RC[$s]:-null}" "$(json_str "${NOTE[$s]}")" "$([ -f "$OUT/$s.log" ] && json_str "$s.log" || echo null)"
    done
    printf '\n ]\n}\n'
  } >"$tmp" && mv -f "$tmp" "$OUT/device_check.json"
}

print_summary() {
  local s gpu=${GPU_NAME:-no GPU}
  echo
  echo "---- device_check: $(overall) in $(elapsed_s) s of ${BUDGET} s; commit $COMMIT; $gpu${CC:+ (sm_$CC)}$([ "$DRY" = 1 ] && echo ', dry run') ----"
  printf '%-13s %-8s %7s %6s  %s\n' step state seconds limit note
  for s in "${STEPS[@]}"; do
    printf '%-13s %-8s %7s %6s  %s\n' "$s" "${STATE[$s]}" "${SECS[$s]}" "${LIMIT[$s]}" "${NOTE[$s]:0:100}"
  done
  echo "logs and JSON: $OUT"
}

# ---- running a step ------------------------------------------------------------------------------
STEP_PID=""
on_signal() {
  trap - TERM INT HUP
  [ -n "$STEP_PID" ] && kill -TERM "$STEP_PID" 2>/dev/null && wait "$STEP_PID" 2>/dev/null
  local s
  for s in "${STEPS[@]}"; do
    case ${STATE[$s]} in
      running) STATE[$s]="cut"; NOTE[$s]="the run was stopped by a signal" ;;
      pending) STATE[$s]=skipped; NOTE[$s]="the run was stopped before this step" ;;
    esac
  done
  write_json
  print_summary
  exit 143
}
trap on_signal TERM INT HUP

later_caps() {  # the caps of the steps after $1
  local s seen=0 sum=0
  for s in "${STEPS[@]}"; do
    ((seen)) && sum=$((sum + CAP[$s]))
    [ "$s" = "$1" ] && seen=1
  done
  echo $sum
}

last_line() { grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -1 | tr -d '\r' | cut -c1-160; }

# run_step NAME: runs step_NAME (or $DEVICE_CHECK_CMD_NAME) under its time limit.
run_step() {
  local name=$1 log="$OUT/$1.log"
  if [[ $SELECTED != *",$name,"* && $name != machine ]]; then  # the machine's description always
    STATE[$name]=skipped; NOTE[$name]="not selected (DEVICE_CHECK_STEPS)"; write_json; return
  fi
  if [ -n "${NEEDS_BUILD[$name]:-}" ] && [[ ${STATE[build]} == failed || ${STATE[build]} == cut ]]; then
    STATE[$name]=skipped; NOTE[$name]="needs the build, which ${STATE[build]}"; write_json; return
  fi
  local avail=$((BUDGET - $(elapsed_s) - $(later_caps "$name")))
  local limit=$avail
  [ -z "${ELASTIC[$name]:-}" ] && ((limit > CAP[$name])) && limit=${CAP[$name]}
  if ((limit < 1)); then
    STATE[$name]="cut"; NOTE[$name]="no time left in the budget"; write_json; return
  fi
  local grace=0
  ((limit >= 4)) && grace=1
  ((limit >= 20)) && grace=5
  local cmd_var=DEVICE_CHECK_CMD_$name cmd="step_$name"
  [ -n "${!cmd_var:-}" ] && cmd=${!cmd_var}
  LIMIT[$name]=$limit; STATE[$name]=running
  write_json
  echo "==== $name: limit ${limit} s ($(elapsed_s) s of ${BUDGET} s used) ===="
  local t0 rc
  t0=$(now_ms)
  : >"$log"
  if ((grace > 0)); then
    STEP_LIMIT=$limit timeout --kill-after="$grace" "$((limit - grace))" bash -o pipefail -c "$cmd" >"$log" 2>&1 &
  else
    STEP_LIMIT=$limit timeout --signal=KILL "$limit" bash -o pipefail -c "$cmd" >"$log" 2>&1 &
  fi
  STEP_PID=$!
  tail --pid="$STEP_PID" -s 0.2 -n +1 -f "$log" &
  local tail_pid=$!
  wait "$STEP_PID"
  rc=$?
  STEP_PID=""
  wait "$tail_pid" 2>/dev/null
  SECS[$name]=$((($(now_ms) - t0 + 500) / 1000))
  RC[$name]=$rc
  local note
  note=$(last_line "$log")
  case $rc in
    0) STATE[$name]=passed ;;
    77) STATE[$name]=skipped ;;
    124 | 137) STATE[$name]="cut"; note="cut at its limit of ${limit} s; last: $note" ;;
    *) STATE[$name]=failed ;;
  esac
  # The machine's description is information only: even cut short (a small budget scales its
  # cap down to 1 s) it does not fail the run.
  [ "$name" = machine ] && STATE[$name]=ran
  NOTE[$name]=$note
  write_json
  echo "---- $name: ${STATE[$name]} in ${SECS[$name]} s (rc $rc)"
}

# ---- the steps (each runs in its own bash under `timeout`) -------------------------------------
step_machine() {
  if command -v nvidia-smi >/dev/null; then
    timeout 8 nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  command -v nvcc >/dev/null && timeout 5 nvcc --version | tail -2
  echo "python: $("$PY" --version 2>&1) at $PY"
  timeout 8 "$PY" -c "import jax, jaxlib, numpy; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'numpy', numpy.__version__)"
  "$PY" -c "import importlib.util as u
print('installed:', ', '.join(f'{m} ' + ('yes' if u.find_spec(m) else 'NO') for m in
      ('pytest', 'pytest_timeout', 'triton', 'flax', 'nanobind', 'scikit_build_core', 'matplotlib')))"
  echo "cmake: $(cmake --version 2>/dev/null | head -1), ninja: $(ninja --version 2>/dev/null || echo none), $(nproc) CPUs"
  command -v compute-sanitizer >/dev/null && echo "compute-sanitizer: $(compute-sanitizer --version 2>/dev/null | tail -1)"
  [ "$DRY" = 1 ] && echo "dry run: no GPU used; archs $JAX_FLASH_CUDA_ARCHS as if sm_$CC"
  return 0
}

step_build() {
  local cuda=ON want=True emu=OFF bdir="_skbuild/device-check-sm$CC"
  # The dry run runs the kernels on the host emulation: its module too (JAX_FLASH_EMULATOR).
  if [ "$DRY" = 1 ]; then cuda=OFF want=False emu=ON bdir=_skbuild/device-check-emulated; fi
  local gen=()
  command -v ninja >/dev/null && gen=(-G Ninja)
  echo "+ cmake: JAX_FLASH_CUDA=$cuda JAX_FLASH_CUDA_ARCHS=$JAX_FLASH_CUDA_ARCHS JAX_FLASH_EMULATOR=$emu in $bdir, $JOBS jobs"
  cmake -S cuda -B "$bdir" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DJAX_FLASH_CUDA="$cuda" \
    -DJAX_FLASH_CUDA_ARCHS="$JAX_FLASH_CUDA_ARCHS" -DJAX_FLASH_EMULATOR="$emu" -DPython_EXECUTABLE="$PY" || return 1
  cmake --build "$bdir" -j "$JOBS" || return 1
  cp "$bdir"/_jax_flash_ext*.so jax_flash/ || return 1
  if [ "$emu" = ON ]; then cp "$bdir"/_jax_flash_emu*.so jax_flash/ || return 1; fi
  "$PY" -c "import jax_flash._jax_flash_ext as e; print('built', e.__file__, '- cuda kernels:', e.has_cuda()); assert e.has_cuda() == $want"
}

step_ptx_selftest() {
  local t=$WORK/selftest w missing=""
  mkdir -p "$t"
  # Every wrapper of ptx.h (each has an emulation: emu::NAME) must be exercised by the self-test.
  for w in $(grep -o 'emu::[A-Za-z0-9_]*' cuda/kernels/ptx.h | sed 's/^emu:://' | sort -u); do
    grep -q "ptx::${w}\b" build/ptx_selftest.cu || missing="$missing $w"
  done
  [ -n "$missing" ] && echo "FAIL coverage: wrappers of cuda/kernels/ptx.h that build/ptx_selftest.cu does not test:$missing"
  echo "+ the emulated side, and the host driver (both sides emulated), with the host compiler"
  local cxx=${CXX:-g++} pids=() p ok=1
  "$cxx" -std=c++17 -O1 -DJAX_FLASH_EMULATE -Icuda -x c++ -c build/ptx_selftest.cu -o "$t/emu_side.o" & pids+=($!)
  "$cxx" -std=c++17 -O1 -DJAX_FLASH_EMULATE -DJAX_FLASH_SELFTEST_HOST_DRIVER -Icuda -x c++ -c build/ptx_selftest.cu \
    -o "$t/host_side.o" & pids+=($!)
  "$cxx" -std=c++17 -O1 -Icuda -c cuda/emu/simt.cc -o "$t/simt.o" & pids+=($!)
  "$cxx" -std=c++17 -O1 -Icuda -c cuda/emu/ptx_emu.cc -o "$t/ptx_emu.o" & pids+=($!)
  for p in "${pids[@]}"; do wait "$p" || ok=0; done
  ((ok)) || { echo "FAIL: the emulated side does not compile"; return 1; }
  # The comparisons themselves: identical sides pass, a perturbed side fails every check.
  if ! { "$cxx" "$t/host_side.o" "$t/emu_side.o" "$t/simt.o" "$t/ptx_emu.o" -o "$t/host_selftest" &&
    "$t/host_selftest" | tail -1 && JAX_FLASH_SELFTEST_PERTURB=1 "$t/host_selftest" | tail -1; }; then
    echo "FAIL: the self-test's host driver"
    return 1
  fi
  if ! command -v nvcc >/dev/null; then
    echo "no nvcc: the GPU side is not built"
    [ "$DRY" = 1 ] && { [ -z "$missing" ] && return 77; return 1; }
    return 1
  fi
  echo "+ nvcc -arch=sm_$CC: the GPU side and the driver"
  nvcc -std=c++17 -O2 -arch="sm_$CC" -Icuda build/ptx_selftest.cu "$t/emu_side.o" "$t/simt.o" "$t/ptx_emu.o" \
    -o "$t/ptx_selftest" || return 1
  "$t/ptx_selftest"
  local rc=$?
  [ -n "$missing" ] && return 1
  if ((rc == 2)) && [ "$DRY" = 1 ]; then
    echo "host driver passed; GPU side built, not run: no GPU (dry run)"
    return 77
  fi
  return $rc
}

step_correctness() {
  export JAX_FLASH_REQUIRE=cuda
  [ "$DRY" = 1 ] && export JAX_FLASH_GPU_SUITE=emulated
  if "$PY" -c "import pytest" 2>/dev/null; then
    # -o addopts=: pyproject.toml asks for pytest-xdist workers, which this machine may lack.
    # Each test spends most of its time compiling (on the H200, 53 tests took 206 s for the
    # first 24 in one process and 123 s for all with 8 workers): one worker per two CPUs, up to
    # 8, where pytest-xdist is installed.
    local workers=$((JOBS / 2)) parallel=()
    ((workers > 8)) && workers=8
    ((workers >= 2)) && "$PY" -c "import xdist" 2>/dev/null && parallel=(-n "$workers")
    "$PY" -m pytest -o addopts= tests/internals/test_gpu.py -m gpu -v -p no:cacheprovider -rfEs --durations=5 \
      "${parallel[@]}"
  else
    echo "pytest is not installed: tests/internals/test_gpu.py's own runner"
    "$PY" tests/internals/test_gpu.py
  fi
}

step_bench() {
  # The benchmark stops starting cases at 3/4 of the step's limit, so that the case under way
  # can finish and bench.json is complete; cases not started are reported as cut. The first
  # run (every implementation, the kernels' default layout) may start cases until 1/2 of the
  # limit, the second (cuda only, JAX_FLASH_CUDA_LAYOUT=warp32, a quarter of the cells) in
  # what is left until 3/4; its cells are merged into bench.json as impl "cuda:warp32".
  local budget=$((STEP_LIMIT * 3 / 4)) first=$((STEP_LIMIT / 2)) sizes t0 rest rc
  ((budget < 1)) && budget=1
  ((first < 1)) && first=1
  if [ "$DRY" = 1 ]; then
    sizes="--impls jax.nn,jax.nn-cudnn,jax-pallas,cuda,xla --seq-lens 128 --head-dims 64 --batch 1 --heads 2 --reps 2 --max-seconds 0.5"
  else
    sizes="--impls jax.nn,jax.nn-cudnn,jax-pallas,cuda,pallas,pallas-mosaic --seq-lens 8k --head-dims 128,64 --batch 2 --heads 16 --reps 20 --max-seconds 1 --max-temp-gib 64"
  fi
  t0=$(date +%s)
  # shellcheck disable=SC2086 # word splitting of the argument list is intended
  JAX_FLASH_CUDA_LAYOUT=warp16 "$PY" -m jax_flash.bench --dtype bfloat16 --passes both --causal both \
    ${DEVICE_CHECK_BENCH_ARGS:-$sizes} --time-budget "$first" --json "$OUT/bench.json"
  rc=$?
  # Then one decode cell (a quarter of the limit at most; the H200's decode bandwidth), then the
  # warp32 layout in what is left until 3/4.
  rest=$((budget - ($(date +%s) - t0)))
  if ((rest < 1)); then
    echo "bench: no time left for the decode cell and the warp32 layout"
    return $rc
  fi
  local decode=$((STEP_LIMIT / 4)) dsizes
  ((decode > rest)) && decode=$rest
  if [ "$DRY" = 1 ]; then
    dsizes="--batch 1 --seq-lens 256 --heads 4 --kv-heads 2 --head-dim 64 --reps 2 --impls jax.nn,cuda,paged-cuda"
  else
    dsizes="--batch 8 --seq-lens 32k --reps 5 --impls jax.nn,jax.nn-cudnn,cuda,paged-cuda,pallas,xla"
  fi
  echo "+ one decode cell, at most ${decode} s"
  # shellcheck disable=SC2086
  timeout "$decode" "$PY" -m jax_flash.bench --decode --dtype bfloat16 $dsizes --json "$WORK/bench_decode.json" ||
    rc=1
  merge_decode_bench "$OUT/bench.json" "$WORK/bench_decode.json" || rc=1
  rest=$((budget - ($(date +%s) - t0)))
  if ((rest < 1)); then
    echo "bench: no time left for the warp32 layout"
    return $rc
  fi
  echo "+ the cuda kernels again, JAX_FLASH_CUDA_LAYOUT=warp32, ${rest} s"
  # shellcheck disable=SC2086
  JAX_FLASH_CUDA_LAYOUT=warp32 "$PY" -m jax_flash.bench --dtype bfloat16 --passes both --causal both \
    ${DEVICE_CHECK_BENCH_ARGS:-$sizes} --impls cuda --time-budget "$rest" --json "$WORK/bench_warp32.json" ||
    rc=1
  merge_layout_bench "$OUT/bench.json" "$WORK/bench_warp32.json" || rc=1
  return $rc
}

# Puts the decode cells under "decode" in bench.json.
merge_decode_bench() {
  "$PY" - "$1" "$2" <<'PYEOF'
import json, os, sys
main_path, extra_path = sys.argv[1], sys.argv[2]
if not os.path.exists(main_path) or not os.path.exists(extra_path):
    sys.exit(f"bench: no decode cells to merge ({main_path if not os.path.exists(main_path) else extra_path} missing)")
main, extra = json.load(open(main_path)), json.load(open(extra_path))
main["decode"] = {"peak": extra.get("peak"), "shape": extra.get("shape"), "results": extra.get("results", [])}
tmp = main_path + ".tmp"
json.dump(main, open(tmp, "w"), indent=1)
os.replace(tmp, main_path)
print(f"bench: {len(main['decode']['results'])} decode cells merged into {main_path}")
PYEOF
}

# Appends the second layout's cells to bench.json as impl "cuda:warp32", with their ratio to the
# first run's jax.nn cell of the same case, and recounts.
merge_layout_bench() {
  "$PY" - "$1" "$2" <<'PYEOF'
import json, os, sys
main_path, extra_path = sys.argv[1], sys.argv[2]
if not os.path.exists(main_path) or not os.path.exists(extra_path):
    sys.exit(f"bench: nothing to merge ({main_path if not os.path.exists(main_path) else extra_path} missing)")
main, extra = json.load(open(main_path)), json.load(open(extra_path))
key = lambda r: (r.get("pass"), r.get("causal"), r.get("head_dim"), r.get("seq_len"))
nn = {key(r): r.get("time_s") for r in main["results"] if r.get("impl") == "jax.nn" and r.get("time_s")}
added = [dict(r, impl="cuda:warp32", layout="warp32") for r in extra["results"] if r.get("impl") == "cuda"]
for r in added:
    t = r.get("time_s")
    r["vs_jax_nn"] = nn[key(r)] / t if t and key(r) in nn else None
for r in main["results"]:
    if r.get("impl") == "cuda":
        r["layout"] = "warp16"
main["results"] += added
counts = {"ok": 0, "failed": 0, "OOM": 0, "skipped": 0, "cut": 0}
for r in main["results"]:
    k = str(r.get("status", "")).split(":")[0]
    counts[k if k in counts else "failed"] += 1
main["counts"], main["complete"] = counts, bool(main.get("complete")) and bool(extra.get("complete"))
main["layouts"] = {"cuda": "warp16", "cuda:warp32": "warp32"}
tmp = main_path + ".tmp"
json.dump(main, open(tmp, "w"), indent=1)
os.replace(tmp, main_path)
ok = sum(r.get("status") == "ok" for r in added)
print(f"bench: {counts['ok']} of {len(main['results'])} cells measured ({ok} of {len(added)} cuda:warp32)")
PYEOF
}

sanitize() {  # memcheck or racecheck of build/sanitizer_case.py
  local tool=$1
  if [ "$DRY" = 1 ]; then
    echo "dry run: build/sanitizer_case.py emulated, without compute-sanitizer ($tool)"
    "$PY" build/sanitizer_case.py
    return
  fi
  local san
  san=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null) ||
    { echo "compute-sanitizer: not found"; return 77; }
  # One cudaMalloc per buffer (XLA's platform allocator), so that memcheck sees each buffer's
  # bounds; only the jax_flash kernels are instrumented.
  local extra=()
  [ "$tool" = memcheck ] && extra=(--padding 256)
  XLA_PYTHON_CLIENT_ALLOCATOR=platform "$san" --tool "$tool" --error-exitcode 1 --target-processes application-only \
    --report-api-errors no --kernel-name kns=jax_flash --print-limit 20 "${extra[@]}" "$PY" build/sanitizer_case.py
}
step_memcheck() { sanitize memcheck; }
step_racecheck() { sanitize racecheck; }

step_profile() {  # Nsight Compute: where the first forward and backward launches stall
  if [ "$DRY" = 1 ]; then
    echo "dry run: build/profile_case.py emulated, without ncu"
    "$PY" build/profile_case.py --seq-len 256
    return
  fi
  local ncu
  ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null) || { echo "ncu: not found"; return 77; }
  # The kernels that do the work: a routed call also launches the general kernel, whose CTAs
  # read the route and exit. Launches in order: the forward's, the forward's and the backward's.
  "$ncu" --kernel-name regex:'attention_(forward|backward)_plain_kernel' --launch-count 3 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    "$PY" build/profile_case.py --head-dim 128
}

step_mosaic() {  # the pallas Mosaic GPU forward: correct, then how fast beside its peers
  if [ "$DRY" = 1 ]; then
    "$PY" build/mosaic_check.py --dry-run
    return
  fi
  "$PY" build/mosaic_check.py
}

export -f step_machine step_build step_ptx_selftest step_correctness step_bench merge_layout_bench merge_decode_bench sanitize \
  step_memcheck step_racecheck step_profile step_mosaic
export DRY PY WORK OUT JOBS

# ---- the run ---------------------------------------------------------------------------------------
if [ "$DRY" = 1 ]; then
  CC=${DEVICE_CHECK_CC:-90}
else
  CC=$(timeout 8 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
  GPU_NAME=$(timeout 8 nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  if [ -z "$CC" ]; then
    CC=90
    echo "device_check: nvidia-smi gave no compute capability: building for sm_90" >&2
  fi
fi
export CC JAX_FLASH_CUDA_ARCHS=${JAX_FLASH_CUDA_ARCHS:-${CC}-real}

print_plan
write_json
for s in "${STEPS[@]}"; do
  run_step "$s"
  if [ "$s" = machine ] && [ -f "$OUT/machine.log" ]; then
    MACHINE_TEXT=$(cat "$OUT/machine.log")
    rm -f "$OUT/machine.log"  # kept in device_check.json: $OUT holds at most 8 files
    NOTE[machine]="${GPU_NAME:-no GPU}; $(grep -m1 '^jax ' <<<"$MACHINE_TEXT")"
    write_json
  fi
  if [ "$s" = mosaic ] && [ -f "$OUT/mosaic.log" ]; then
    MOSAIC_TEXT=$(cat "$OUT/mosaic.log")
    rm -f "$OUT/mosaic.log"  # kept in device_check.json: $OUT holds at most 8 files
  fi
  if [ "$s" = profile ] && [ -f "$OUT/profile.log" ]; then
    PROFILE_TEXT=$(cat "$OUT/profile.log")
    rm -f "$OUT/profile.log"  # kept in device_check.json: $OUT holds at most 8 files
    write_json
  fi
done
print_summary
[ "$(overall)" = passed ]
