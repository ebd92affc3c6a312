#!/usr/bin/env bash
# The repository's habits, as CI checks them (.ci/run calls this before the builds):
#   ruff check              Python lint        ([tool.ruff.lint] in pyproject.toml)
#   ruff format --check     Python format      ([tool.ruff.format])
#   clang-format -Werror    C++/CUDA format    (.clang-format) over cuda/ and build/*.cu
#   mypy                    types of jax_flash/ ([tool.mypy])
# The tools are the versions pinned in pyproject.toml's `dev` extra, installed first with what
# the type check imports (LINT_INSTALL=0 skips that, for a machine that has them). Every check
# runs; the script exits 1 if any failed, and prints how long each took.
#
#   bash build/lint.sh            # check
#   bash build/lint.sh --fix      # apply ruff's safe fixes, ruff format and clang-format -i, then check
set -uo pipefail
cd "$(dirname "$0")/.."
fix=0
[ "${1:-}" = "--fix" ] && fix=1

if [ "${LINT_INSTALL:-1}" != "0" ]; then
  # The `dev` extra's requirements, without building the package itself.
  mapfile -t reqs < <(python - <<'PY'
import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["dev"]))
PY
)
  python -m pip install -q --disable-pip-version-check "${reqs[@]}" || exit 1
fi
clang_format=$(python -c "import clang_format; print(clang_format.get_executable('clang-format'))") || exit 1

# The C++ sources: tracked files (a tree without git: every file under the same paths).
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  mapfile -t cxx < <(git ls-files 'cuda/*.h' 'cuda/*.cc' 'cuda/*.cu' 'cuda/*.cuh' 'cuda/*.inc' 'build/*.cu')
else
  mapfile -t cxx < <({ find cuda -type f \( -name '*.h' -o -name '*.cc' -o -name '*.cu' -o -name '*.cuh' \
                        -o -name '*.inc' \); find build -maxdepth 1 -name '*.cu'; } | sort)
fi

failed=()
step() {  # step NAME COMMAND...: run, time, remember a failure
  local name=$1 t0=$SECONDS
  shift
  echo "== lint: $name"
  if "$@"; then
    echo "   ok ($((SECONDS - t0)) s)"
  else
    echo "   FAILED ($((SECONDS - t0)) s)"
    failed+=("$name")
  fi
}

if [ $fix = 1 ]; then
  python -m ruff check --fix -q . || true
  python -m ruff format -q .
  "$clang_format" -i "${cxx[@]}"
fi
step "ruff check" python -m ruff check --output-format concise .
step "ruff format" python -m ruff format --check .
step "clang-format (${#cxx[@]} files)" "$clang_format" --dry-run -Werror "${cxx[@]}"
step "mypy" python -m mypy

if [ ${#failed[@]} -gt 0 ]; then
  echo "lint: failed: ${failed[*]}"
  exit 1
fi
echo "lint: all passed"
