#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the wheels the H200 image lacks, into
# experiments/gpu/wheels/ (git-ignored). The device run installs them offline:
#   pip install --no-index --no-deps <wheels not already installed there>
#
# What the image lacks (KINDS.md's package list) and pcframe needs:
#   at import time of pcframe / pcframe.kernels: crc32c, zstandard
#   to collect every test module (pytest -m gpu tests): hydra-core, omegaconf,
#     antlr4-python3-runtime (hydra / the apps' configs), optuna + alembic, sqlalchemy,
#     mako, colorlog (the tuning app).  s3fs, moto, psycopg and torchdata are optional:
#     their tests importorskip them.
# Versions are the ones this repository's .venv runs its tests with. The image's Python is
# 3.12 on x86-64. antlr4-python3-runtime 4.9.3 (omegaconf 2.3 pins 4.9.*) exists only as
# an sdist: it is pure Python, so it is built here into a py3-none-any wheel.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEST="${1:-$HERE/wheels}"
PY="${PYTHON:-python3}"
mkdir -p "$DEST"

BINARY=(
  crc32c==2.9.post0
  zstandard==0.25.0
  hydra-core==1.3.8
  omegaconf==2.3.1
  optuna==5.0.0
  alembic==1.20.1
  mako==1.4.3
  sqlalchemy==2.1.9
  colorlog==6.12.0
)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64)
plat_args=()
for p in "${PLATFORMS[@]}"; do plat_args+=(--platform "$p"); done

"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat_args[@]}" -d "$DEST" "${BINARY[@]}"

if ! ls "$DEST"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
  "$PY" -m pip wheel --quiet --no-deps -w "$DEST" antlr4-python3-runtime==4.9.3
fi

# One version of each distribution: two make the offline install fail.
"$PY" - "$DEST" <<'PYEOF'
import collections, pathlib, re, sys
dest = pathlib.Path(sys.argv[1])
names = collections.defaultdict(list)
for whl in sorted(dest.glob("*.whl")):
    names[re.sub(r"[-_.]+", "-", whl.name.split("-")[0]).lower()].append(whl.name)
dupes = {n: v for n, v in names.items() if len(v) > 1}
if dupes:
    sys.exit(f"several versions of one distribution in {dest}: {dupes}; keep one")
total = sum(p.stat().st_size for p in dest.glob("*.whl"))
print(f"{len(names)} wheels, {total / 2**20:.1f} MiB in {dest}")
for n in sorted(names):
    print("  ", names[n][0])
PYEOF
