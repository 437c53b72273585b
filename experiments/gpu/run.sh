#!/usr/bin/env bash
# pcframe on a bare H200 machine: install offline, then tests, kernel bandwidths, the engine
# on a training loop and the environment, each part under its own time budget, everything
# written under $OUT (results.json, gpu_h200.md, run.log, ...). See experiments/gpu/README.md.
#
#   bash experiments/gpu/run.sh                 # on the device (OUT is set there)
#   OUT=/tmp/gpu_dry bash experiments/gpu/run.sh --dry-run    # here, CPU, toy sizes
#   bash experiments/gpu/run.sh --only engine   # one part again (env,tests,kernels,engine)
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
cd "$REPO"

DRY=0
ONLY="env,tests,kernels,engine"
ENGINE_ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --only) ONLY="$2"; shift ;;
    --engine-args) read -r -a ENGINE_ARGS <<<"$2"; shift ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

OUT="${OUT:-$([[ $DRY == 1 ]] && echo /tmp/gpu_dry || echo /tmp/gpu_out)}"
WORK="$OUT/work"
rm -rf "$WORK"
mkdir -p "$WORK"
exec > >(tee -a "$OUT/run.log") 2>&1
T0=$(date +%s)
stamp() { echo "[$(date +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*"; }
has() { [[ ",$ONLY," == *",$1,"* ]]; }

# Seconds per part. On the device the sum (plus install) stays under 8 minutes, so a call
# with timeout_s=540 ends with time to spare; each part is killed at its own budget.
if [[ $DRY == 1 ]]; then
  B_ENV=30; B_TESTS_GPU=120; B_TESTS_KERNELS=120; B_KERNELS=90; B_ENGINE=170
else
  B_ENV=15; B_TESTS_GPU=85; B_TESTS_KERNELS=45; B_KERNELS=60; B_ENGINE=235
fi

if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ $DRY == 1 && -x "$REPO/.venv/bin/python" ]]; then PY="$REPO/.venv/bin/python"
else PY=python3; fi
export PYTHONUNBUFFERED=1
DRYFLAG=()
if [[ $DRY == 1 ]]; then
  DRYFLAG=(--dry-run)
  export TRITON_INTERPRET=1      # Triton kernels run in the CPU interpreter
else
  unset TRITON_INTERPRET         # compiled for the GPU, never the interpreter
fi
stamp "pcframe GPU run: dry_run=$DRY parts=$ONLY OUT=$OUT python=$PY"

# --- install (offline) ---------------------------------------------------------------------
WHEELS="$HERE/wheels"
install_shim() {
  # Fallback when pip cannot install into the image's environment: a sitecustomize that
  # maps pcframe.{policies,kernels,conf} onto the source folders (what setup.py does).
  local shim=/tmp/pcframe_shim
  mkdir -p "$shim"
  cat >"$shim/sitecustomize.py" <<PYEOF
import importlib.util, sys
sys.path.insert(0, "$REPO")
_MAP = {"pcframe.policies": "$REPO/policies", "pcframe.kernels": "$REPO/kernels",
        "pcframe.conf": "$REPO/conf"}
class _Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        root = _MAP.get(name)
        if root is None:
            return None
        return importlib.util.spec_from_file_location(
            name, root + "/__init__.py", submodule_search_locations=[root])
sys.meta_path.insert(0, _Finder())
PYEOF
  export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
}

install() {
  stamp "install: wheels from $WHEELS"
  if [[ ! -d "$WHEELS" ]] || ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "WARNING: no wheels in $WHEELS: run experiments/gpu/fetch_wheels.sh where PyPI is"
    echo "         reachable and carry experiments/gpu/wheels (pcframe imports crc32c, zstandard)"
  else
    # what the image lacks, or has in another version (all are leaf packages here)
    mapfile -t NEED < <("$PY" - "$WHEELS" <<'PYEOF'
import importlib.metadata as md, pathlib, sys
for whl in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have == version:
        print(f"  have {name} {have}", file=sys.stderr)
    else:
        print(whl)
PYEOF
)
    if [[ $DRY == 1 ]]; then
      stamp "install (dry run): checking that the wheels install on CPython 3.12 x86-64"
      rm -rf /tmp/gpu_dry_target
      "$PY" -m pip install --dry-run --quiet --no-index --no-deps --ignore-installed \
        --target /tmp/gpu_dry_target --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64 \
        --platform manylinux1_x86_64 --only-binary=:all: "$WHEELS"/*.whl \
        && echo "  wheels: ok ($(ls "$WHEELS"/*.whl | wc -l) files)" \
        || echo "  WHEELS WOULD NOT INSTALL on the device"
      echo "  not installed here (this environment has them): ${#NEED[@]}"
    elif [[ ${#NEED[@]} -gt 0 ]]; then
      printf '  installing %s\n' "${NEED[@]##*/}"
      if ! "$PY" -m pip install -q --no-index --no-deps --no-compile "${NEED[@]}"; then
        echo "  pip into the environment failed: --target /tmp/site + PYTHONPATH"
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${NEED[@]}"
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
      fi
    fi
  fi
  if [[ $DRY == 1 ]]; then
    stamp "install (dry run): pip install --dry-run --no-index --no-deps --no-build-isolation -e ."
    "$PY" -m pip install --dry-run -q --no-index --no-deps --no-build-isolation -e . \
      && echo "  editable install: ok" || echo "  EDITABLE INSTALL WOULD FAIL"
  else
    stamp "install: pip install --no-index --no-deps --no-build-isolation -e ."
    if ! "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
      echo "  editable install failed: import shim (sitecustomize) instead"
      install_shim
    fi
  fi
  "$PY" - <<'PYEOF'
import importlib
for name in ("pcframe", "pcframe.kernels", "pcframe.policies", "crc32c", "zstandard",
             "xxhash", "numba", "triton", "hydra", "omegaconf", "optuna"):
    try:
        m = importlib.import_module(name)
        print(f"  import {name}: ok {getattr(m, '__version__', '')}")
    except Exception as exc:
        print(f"  import {name}: FAILED {type(exc).__name__}: {exc}")
PYEOF
}
install
stamp "install done"

part() {  # part NAME BUDGET command...
  local name=$1 budget=$2
  shift 2
  stamp "part $name (budget ${budget}s)"
  timeout -k 10 "$budget" "$@"
  local rc=$?
  [[ $rc == 124 || $rc == 137 ]] && echo "PART $name HIT ITS BUDGET (${budget}s)"
  stamp "part $name done rc=$rc"
  return 0
}
BENCH=("$PY" "$HERE/gpu_bench.py")

if has env; then
  part env "$B_ENV" "${BENCH[@]}" env --work "$WORK" "${DRYFLAG[@]}"
fi

if has tests; then
  TOPT=()
  "$PY" -c "import pytest_timeout" 2>/dev/null && TOPT=(--timeout=120)
  run_pytest() {  # run_pytest NAME BUDGET pytest-args...
    local name=$1 budget=$2
    shift 2
    stamp "tests $name: pytest $*"
    timeout -k 10 "$budget" "$PY" -m pytest -p no:cacheprovider -q -rfEs "${TOPT[@]}" \
      --junitxml="$WORK/junit_$name.xml" "$@" >"$WORK/tests_$name.log" 2>&1
    echo $? >"$WORK/tests_$name.rc"
    tail -n 12 "$WORK/tests_$name.log"
  }
  # every gpu-marked test (a missing optional package must not stop the collection)
  run_pytest gpu "$B_TESTS_GPU" -m gpu --continue-on-collection-errors tests
  # the rest of the kernel tests, with CUDA visible (Triton CPU-interpreter params skip then;
  # the gpu-marked test_triton_interpreter_suite above replays them in a child process)
  run_pytest kernels "$B_TESTS_KERNELS" -m "not gpu" tests/kernels
  "${BENCH[@]}" tests-summary --work "$WORK" "${DRYFLAG[@]}"
fi

if has kernels; then
  part kernels "$B_KERNELS" "${BENCH[@]}" kernels --work "$WORK" --budget $((B_KERNELS - 8)) \
    "${DRYFLAG[@]}"
fi

if has engine; then
  part engine "$B_ENGINE" "${BENCH[@]}" engine --work "$WORK" --budget $((B_ENGINE - 10)) \
    "${DRYFLAG[@]}" "${ENGINE_ARGS[@]}"
fi

# --- results: at most 8 files come back from $OUT ------------------------------------------
stamp "report"
"${BENCH[@]}" report --work "$WORK" --out "$OUT" \
  --command "bash experiments/gpu/run.sh${DRYFLAG:+ --dry-run}$([[ $ONLY != env,tests,kernels,engine ]] && echo " --only $ONLY")" \
  "${DRYFLAG[@]}" || echo "REPORT FAILED"
for f in env.txt tests_junit.xml; do [[ -f "$WORK/$f" ]] && mv "$WORK/$f" "$OUT/$f"; done
if ls "$WORK"/trace_*.json.gz >/dev/null 2>&1; then
  tar -C "$WORK" -cf "$OUT/traces.tar" $(cd "$WORK" && ls trace_*.json.gz) && rm -f "$WORK"/trace_*.json.gz
fi
tar -C "$OUT" -czf "$OUT/logs.tar.gz" work && rm -rf "$WORK"
echo
ls -la "$OUT"
NFILES=$(find "$OUT" -type f | wc -l)
[[ $NFILES -gt 8 ]] && echo "WARNING: $NFILES files under \$OUT; only 8 come back"
stamp "all done in $(( $(date +%s) - T0 )) s"
echo
cat "$OUT/gpu_h200.md" 2>/dev/null | sed -n '/^## Goals/,/^## Kernel/p'
