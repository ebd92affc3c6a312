#!/usr/bin/env bash
# One run on a GPU machine: build, check the PTX wrappers against the emulation, run the GPU
# tests, memcheck a small case, benchmark. Written for an H200 (sm_90, jax 0.11.2, Python 3.12,
# no package index: everything needed must already be installed); fits one 8-minute run.
#
#   OUT=/some/dir bash build/device_check.sh
#
# Writes logs and JSON (device_check.json, bench.json, ...) under $OUT and prints a summary
# table last. Exit status: 0 when every step that ran passed.
set -u -o pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$REPO/device_out}
mkdir -p "$OUT"
WORK=$(mktemp -d)
START=$(date +%s)
BUDGET=${DEVICE_CHECK_BUDGET_S:-460}  # seconds for all steps together
PY=${PYTHON:-python}

NAMES=() STATES=() SECONDS_TAKEN=() NOTES=()
record() {  # name state seconds note
  NAMES+=("$1"); STATES+=("$2"); SECONDS_TAKEN+=("$3"); NOTES+=("$4")
}
# run_step NAME CAP_SECONDS COMMAND...: runs with a timeout of min(CAP, time left), logs to $OUT/NAME.log
run_step() {
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  local limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    record "$name" "SKIP" 0 "no time left"
    return 1
  fi
  local t0=$(date +%s)
  timeout --signal=KILL "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  local dt=$(($(date +%s) - t0))
  local note
  note=$(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-70)
  if ((rc == 0)); then record "$name" "PASS" "$dt" "$note"
  elif ((rc == 137 || rc == 124)); then record "$name" "TIMEOUT" "$dt" "after ${limit}s: $note"
  else record "$name" "FAIL($rc)" "$dt" "$note"
  fi
  return $rc
}

# ---- 0. the machine ------------------------------------------------------------------------------
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
CC=${CC:-90}
{
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv 2>&1
  nvcc --version 2>&1 | tail -2
  "$PY" -c "import sys, jax; print(sys.version.split()[0], 'jax', jax.__version__, jax.devices())" 2>&1
} >"$OUT/machine.log"
record machine "INFO" 0 "$(head -2 "$OUT/machine.log" | tail -1 | cut -c1-70)"

# ---- 1. build and install (this GPU's architecture only) -----------------------------------------
export JAX_FLASH_CUDA_ARCHS=${JAX_FLASH_CUDA_ARCHS:-${CC}-real}
export JAX_FLASH_CUDA=ON
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
run_step build 240 "$PY" -m pip install --no-build-isolation --no-deps --no-index -v "$REPO"
BUILD_OK=$?

# ---- 2. PTX wrappers: real instruction vs emulation, lane by lane --------------------------------
selftest() {
  cd "$REPO" &&
    g++ -std=c++17 -O1 -DJAX_FLASH_EMULATE -Icuda -x c++ -c build/ptx_selftest.cu -o "$WORK/emu_side.o" &&
    g++ -std=c++17 -O1 -Icuda -c cuda/emu/simt.cc -o "$WORK/simt.o" &&
    g++ -std=c++17 -O1 -Icuda -c cuda/emu/ptx_emu.cc -o "$WORK/ptx_emu.o" &&
    nvcc -std=c++17 -O2 -arch=sm_"$CC" -Icuda build/ptx_selftest.cu "$WORK/emu_side.o" "$WORK/simt.o" \
      "$WORK/ptx_emu.o" -o "$WORK/ptx_selftest" &&
    "$WORK/ptx_selftest"
}
run_step ptx_selftest 90 bash -c "$(declare -f selftest); REPO='$REPO' WORK='$WORK' CC='$CC' selftest"

# Tests and benchmarks import the installed package: run them from outside the source tree.
cd "$WORK" || exit 1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
if ((BUILD_OK == 0)); then
  # ---- 3. GPU tests: the shared suite for the cuda implementation (full sizes), then -m gpu ------
  # JAX_FLASH_REQUIRE: a cuda implementation that cannot run fails the step instead of skipping.
  JAX_FLASH_REQUIRE=cuda run_step gpu_tests_cuda 120 "$PY" -m pytest "$REPO/tests/test_attention.py" -k cuda -q -x -p no:cacheprovider \
    --junitxml="$OUT/gpu_tests_cuda.xml"
  run_step gpu_tests_marked 60 bash -c "'$PY' -m pytest '$REPO/tests' -m gpu -q -p no:cacheprovider \
    --junitxml='$OUT/gpu_tests_marked.xml'; rc=\$?; [ \$rc -eq 5 ] && echo 'no tests marked gpu' && rc=0; exit \$rc"

  # ---- 4. a small case (forward + backward, ragged, GQA, causal, deterministic mode), then the
  #         same under compute-sanitizer memcheck ---------------------------------------------------
  cat >"$WORK/small_case.py" <<'PYEOF'
# Forward and backward of the cuda kernels on a small ragged GQA causal case, against the
# float32 reference; deterministic mode twice, bit-identical.
import os
import jax, jax.numpy as jnp, numpy as np
import jax_flash
from jax_flash.reference import attention_reference

def grads(fn, q, k, v, cot):
    f = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * cot)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(q, k, v)

QUICK = os.environ.get("SMALL_CASE_QUICK") == "1"  # under compute-sanitizer: one configuration
for dtype in (jnp.bfloat16,) if QUICK else (jnp.bfloat16, jnp.float16):
    for h in (64,) if QUICK else (64, 128):
        kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(h), 4)
        q = jax.random.normal(kq, (2, 97, 4, h), dtype)
        k = jax.random.normal(kk, (2, 130, 2, h), dtype)
        v = jax.random.normal(kv, (2, 130, 2, h), dtype)
        cot = jax.random.normal(kc, q.shape, jnp.float32)
        cuda = lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="cuda")
        ref = lambda q, k, v: attention_reference(q, k, v, is_causal=True, compute_dtype=jnp.float32)
        (val, g), (rval, rg) = grads(cuda, q, k, v, cot), grads(ref, q, k, v, cot)
        errs = [float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)))) for a, b in zip(g, rg)]
        scale = max(float(np.max(np.abs(np.asarray(b, np.float32)))) for b in rg)
        assert all(np.isfinite(e) and e <= 0.05 * scale for e in errs), (dtype, h, errs, scale)
        os.environ["JAX_FLASH_DETERMINISTIC"] = "1"
        d1 = grads(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="cuda"), q, k, v, cot)[1]
        d2 = grads(lambda q, k, v: jax_flash.attention(q, k, v, is_causal=True, implementation="cuda"), q, k, v, cot)[1]
        del os.environ["JAX_FLASH_DETERMINISTIC"]
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(d1, d2)), "deterministic differs"
        print(dtype.__name__, h, "grad errors", ["%.3g" % e for e in errs], "of", "%.3g" % scale, "deterministic ok")
PYEOF
  run_step small_case 60 "$PY" "$WORK/small_case.py"
  SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  if [ -n "$SANITIZER" ]; then
    SMALL_CASE_QUICK=1 run_step memcheck 120 "$SANITIZER" --tool memcheck --error-exitcode 1 --target-processes all "$PY" "$WORK/small_case.py"
  else
    record memcheck "SKIP" 0 "compute-sanitizer not found"
  fi

  # ---- 5. benchmark ------------------------------------------------------------------------------
  # The cuda kernels against cuDNN (through jax.nn) and the Pallas kernels: 16 cases x 3.
  run_step bench 200 "$PY" -m jax_flash.bench --impls cuda,jax.nn-cudnn,pallas --seq-lens 2k,8k --head-dims 64,128 \
    --dtype bfloat16 --passes both --causal both --max-seconds 1 --json "$OUT/bench.json"
else
  for s in gpu_tests_cuda gpu_tests_marked small_case memcheck bench; do record "$s" "SKIP" 0 "build failed"; done
fi

# ---- summary -------------------------------------------------------------------------------------
FAILED=0
{
  printf '{"compute_capability": "%s", "archs": "%s", "steps": [' "$CC" "$JAX_FLASH_CUDA_ARCHS"
  for i in "${!NAMES[@]}"; do
    ((i > 0)) && printf ', '
    note=${NOTES[$i]//\\/\\\\}
    note=${note//\"/\\\"}
    printf '{"step": "%s", "state": "%s", "seconds": %s, "note": "%s"}' "${NAMES[$i]}" "${STATES[$i]}" \
      "${SECONDS_TAKEN[$i]}" "$note"
  done
  printf ']}\n'
} >"$OUT/device_check.json"
if [ -f "$OUT/bench.log" ]; then
  echo "---- bench (from $OUT/bench.log) ----"
  tail -40 "$OUT/bench.log"
fi
echo
echo "---- device_check summary ($(($(date +%s) - START)) s; logs and JSON in $OUT) ----"
printf '%-18s %-10s %6s  %s\n' step state seconds note
for i in "${!NAMES[@]}"; do
  printf '%-18s %-10s %6s  %s\n' "${NAMES[$i]}" "${STATES[$i]}" "${SECONDS_TAKEN[$i]}" "${NOTES[$i]}"
  case "${STATES[$i]}" in FAIL*|TIMEOUT) FAILED=1 ;; esac
done
rm -rf "$WORK"
exit $FAILED
