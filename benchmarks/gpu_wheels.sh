#!/usr/bin/env bash
# The wheels `make gpu-check` needs on the lent GPU machine, in .whl/ at the repository root, for one device
# call (`run` with carry [".whl"]; the command lines are in docs/gpu.md).
#
# That machine has Python 3.12, CUDA torch, CuPy 14, ml-dtypes, pyarrow, safetensors, tqdm, tokenizers,
# numpy, protobuf, grpcio, aiohttp, click, filelock, msgpack, packaging, pyyaml, requests and attrs
# (/work/.library/device/KINDS.md), no package registry and no Ray. What raypar still lacks there:
# Ray itself and the one part of Ray's core requirements the image does not hold, jsonschema with its three
# dependencies, and torchao for the fp8 row. Ray's cp312 wheel is 79 MB, over the 64 MiB one device call may
# carry, so it is repacked without what a raypar worker never loads (PRUNE below): then everything fits in
# one call.
#
# Usage: benchmarks/gpu_wheels.sh [PYVER]   (PYVER 3.12 for the device; 3.11 builds the same set for this
# machine's Python, to test the pruned Ray here). PY=... picks the Python whose pip downloads; DEST=...
# another folder than .whl.
set -euo pipefail

PYVER=${1:-3.12}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$([ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || echo python3)}
DEST=${DEST:-$ROOT/.whl}  # the folder the device call carries
# Pinned to the versions raypar's own environment resolves (pyproject.toml), so the device runs what the
# suite tests. rpds-py is the only compiled one besides Ray.
# torchao for the fp8 row: 0.18.0 (the project's pin) needs torch >= 2.11 (its own import check,
# torchao/__init__.py: older torch skips its kernels) and the device has 2.11.0; one abi3 wheel, 3.4 MB, no
# runtime dependencies. Only the second device call (the Ray sections) installs these.
WHEELS=(ray==2.60.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0
  rpds-py==2026.9.1 torchao==0.18.0)
# Parts of Ray's wheel that a raypar run never imports or executes (paths inside the wheel):
#   ray/jars/                   31 MB compressed: the Java worker (raypar's workers are Python)
#   ray/dashboard/client/build/ 2.4 MB: the dashboard's web front end (the device has no dashboard deps,
#                               aiohttp_cors and opencensus, so the dashboard cannot start there anyway)
#   ray/{rllib,data,serve,tune,llm}/  4.1 MB: Ray's libraries, which Ray's core never imports
# Kept: the GCS server, raylet, _raylet.so, the dashboard *agent* and the runtime-env agent (the raylet starts
# both and exits when one dies), ray/train and ray/air (small).
PRUNE="ray/jars/ ray/dashboard/client/build/ ray/rllib/ ray/data/ ray/serve/ ray/tune/ ray/llm/"
LIMIT=$((64 * 1024 * 1024))

mkdir -p "$DEST"
for spec in "${WHEELS[@]}"; do  # stale versions of these packages would make pip install two of one
  name=${spec%%==*}
  rm -f "$DEST/${name//-/_}"-[0-9]*.whl "$DEST/$name"-[0-9]*.whl
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$tmp" "${WHEELS[@]}"
mv "$tmp"/*.whl "$DEST"/
ray_whl=$(ls "$DEST"/ray-2.60.0-*.whl)

# Repack Ray's wheel in place: the same name and tags (pip checks them), RECORD without the pruned files
# (every file left keeps its RECORD hash), and each entry's permission bits, which make the GCS server and
# raylet executable after pip installs them.
"$PY" - "$ray_whl" "$PRUNE" <<'EOF'
import os
import sys
import zipfile

path, prune = sys.argv[1], tuple(sys.argv[2].split())
out = path + ".tmp"
kept = dropped = 0
with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
    for info in src.infolist():
        if info.filename.startswith(prune):
            dropped += info.file_size
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(ln for ln in lines if not ln.startswith(prune)).encode()
        info.compress_type = zipfile.ZIP_DEFLATED
        dst.writestr(info, data, compresslevel=9)
        kept += info.file_size
os.replace(out, path)
print(f"ray wheel pruned: {dropped / 2**20:.0f} MiB of files dropped, {kept / 2**20:.0f} MiB kept")
EOF

total=$(cat "$DEST"/*.whl | wc -c)
tree=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 cat 2>/dev/null | wc -c)
ls -l "$DEST"
echo "wheels: $((total / 1024 / 1024)) MiB; with the working tree ($((tree / 1024 / 1024)) MiB):" \
  "$(((total + tree) / 1024 / 1024)) MiB of the 64 MiB one call may carry"
if [ $((total + tree)) -ge $LIMIT ]; then
  echo "over the limit: prune more of Ray's wheel or split the wheels across two calls" >&2
  exit 1
fi
