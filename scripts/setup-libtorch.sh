#!/usr/bin/env bash
# Makes a CPU libtorch for tch (training only) from PyPI wheels, cached between runs, and
# prints its directory (use: export LIBTORCH="$(scripts/setup-libtorch.sh)").
#
# tch 0.26 expects PyTorch 2.13.0. PyPI's torch==2.13.0 wheel, with nvidia-cuda-runtime and
# nvidia-cuda-cupti (which libtorch_cpu links against), fetched with --no-deps, gives a
# working CPU libtorch once the headers and a handful of libraries are unpacked (~490 MB).
set -euo pipefail
version=2.13.0
cache="${COHABIT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/cohabit}"
dest="$cache/libtorch-$version"
if [ ! -f "$dest/.complete" ]; then
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    echo "setting up libtorch $version in $dest (one-time download of about 540 MB)" >&2
    python3 -m pip download --no-deps -q -d "$tmp" \
        "torch==$version" nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85 >&2
    rm -rf "$dest"
    mkdir -p "$dest/lib" "$dest/include"
    python3 - "$tmp" "$dest" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
wanted = {"libtorch_cpu.so", "libtorch.so", "libc10.so", "libgomp.so.1", "libcudart.so.13", "libcupti.so.13"}
found = set()
for wheel in glob.glob(os.path.join(tmp, "*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            base = os.path.basename(name)
            if name.startswith("torch/include/") and not name.endswith("/"):
                out = os.path.join(dest, "include", name[len("torch/include/"):])
            elif base in wanted and "/lib/" in name:
                out = os.path.join(dest, "lib", base)
                found.add(base)
            else:
                continue
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(name) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst)
missing = wanted - found
if missing:
    sys.exit("libtorch setup: missing " + ", ".join(sorted(missing)))
PY
    touch "$dest/.complete"
fi
echo "$dest"
