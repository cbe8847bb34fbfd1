#!/usr/bin/env bash
# Builds the Debian packages `cohabit` (the daemon) and `cohabit-train` (offline training)
# from this workspace, with dpkg-deb (no cargo-deb: the packages need a second binary
# package with libtorch's libraries and a conffile, which a 60-line script states plainly).
#
#   scripts/build-deb.sh [--profile release|dev] [--out DIR]
#
# --profile release (default) builds optimised binaries; --profile dev packages the test
# build's binaries (what CI does: it checks the package's mechanics without a second
# build). Prints the paths of the two .deb files on stdout, one per line.
#
# `cohabit` holds /usr/bin/cohabit, the systemd unit (not enabled: edit
# /etc/cohabit/cohabit.toml first, then `systemctl enable --now cohabit`), the example
# configuration as a conffile, the shipped models under /usr/share/cohabit/models, the man
# page, shell completions and the docs. `cohabit-train` holds the trainer with the libtorch
# libraries it links (from scripts/setup-libtorch.sh) under /usr/lib/cohabit-train.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=release
out=target/deb
while [ $# -gt 0 ]; do
    case "$1" in
    --profile) profile="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "build-deb.sh: unknown argument '$1' (expected --profile release|dev, --out DIR)" >&2; exit 2 ;;
    esac
done
case "$profile" in
release) bin_dir=target/release; cargo_profile=(--release) ;;
dev) bin_dir=target/debug; cargo_profile=() ;;
*) echo "build-deb.sh: --profile must be release or dev, not '$profile'" >&2; exit 2 ;;
esac
for tool in dpkg-deb strip gzip; do
    command -v "$tool" >/dev/null || { echo "build-deb.sh: '$tool' is missing (apt install dpkg-dev binutils gzip)" >&2; exit 1; }
done
LIBTORCH="${LIBTORCH:-$(./scripts/setup-libtorch.sh)}"
export LIBTORCH
# The package is the full daemon: with the Kubernetes node agent (the DaemonSet's image is
# made from it), which a plain `cargo build` leaves out. scripts/test.sh runs this same build
# before the tests, so --profile dev packages the binaries the tests ran and builds nothing.
cargo build "${cargo_profile[@]}" --locked --features cohabit-controller/kubernetes \
    -p cohabit-controller --bin cohabit -p cohabit-training --bin cohabit-train >&2
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
arch=$(dpkg --print-architecture)
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$out"

# A file into the stage with its mode.
put() { install -D -m "$1" "$2" "$stage/$3"; }

# ---- cohabit ----
root="$stage/cohabit"
put 0755 "$bin_dir/cohabit" cohabit/usr/bin/cohabit
strip --strip-debug "$root/usr/bin/cohabit"
put 0644 examples/cohabit.toml cohabit/etc/cohabit/cohabit.toml
# The unit as shipped in deploy/systemd, with the package's binary path.
sed 's#/usr/local/bin/cohabit#/usr/bin/cohabit#' deploy/systemd/cohabit.service >"$stage/unit"
put 0644 "$stage/unit" cohabit/lib/systemd/system/cohabit.service
for model in models/default/qos-v1 models/xeon-gold-6338/qos-v1-gold; do
    for ext in json safetensors; do
        put 0644 "$model.$ext" "cohabit/usr/share/cohabit/$model.$ext"
    done
done
"$root/usr/bin/cohabit" man | gzip -9n >"$stage/cohabit.1.gz"
put 0644 "$stage/cohabit.1.gz" cohabit/usr/share/man/man1/cohabit.1.gz
"$root/usr/bin/cohabit" completions bash >"$stage/c.bash"
"$root/usr/bin/cohabit" completions zsh >"$stage/c.zsh"
"$root/usr/bin/cohabit" completions fish >"$stage/c.fish"
put 0644 "$stage/c.bash" cohabit/usr/share/bash-completion/completions/cohabit
put 0644 "$stage/c.zsh" cohabit/usr/share/zsh/vendor-completions/_cohabit
put 0644 "$stage/c.fish" cohabit/usr/share/fish/vendor_completions.d/cohabit.fish
for doc in README.md docs/DESIGN.md; do
    put 0644 "$doc" "cohabit/usr/share/doc/cohabit/$(basename "$doc")"
done
printf 'cohabit\nLicense: Apache-2.0 (see /usr/share/common-licenses/Apache-2.0)\n' >"$stage/copyright"
put 0644 "$stage/copyright" cohabit/usr/share/doc/cohabit/copyright
mkdir -p "$root/DEBIAN"
echo /etc/cohabit/cohabit.toml >"$root/DEBIAN/conffiles"
cat >"$root/DEBIAN/control" <<EOF
Package: cohabit
Version: $version
Architecture: $arch
Maintainer: cohabit developers <cohabit@example.invalid>
Depends: libc6 (>= 2.34), libgcc-s1
Recommends: systemd
Section: admin
Priority: optional
Installed-Size: $(du -sk "$root" | cut -f1)
Description: host daemon sharing a server between latency-critical and batch work
 cohabit keeps latency-critical services within their p99 targets while best-effort
 jobs use the rest of the host: cores (cgroup cpusets), last-level cache ways and
 memory bandwidth (resctrl), and GPU shares (NVIDIA MPS).
EOF
# The unit is installed but neither enabled nor started: the example configuration
# names example services, and cohabit refuses to control what it cannot match.
cat >"$root/DEBIAN/postinst" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = configure ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null || true
fi
EOF
cat >"$root/DEBIAN/prerm" <<'EOF'
#!/bin/sh
set -e
if [ "$1" = remove ] && [ -d /run/systemd/system ]; then
    # Stopping restores the host (cgroups, resctrl groups, GPU shares) before removal.
    systemctl stop cohabit.service >/dev/null 2>&1 || true
fi
EOF
chmod 0755 "$root/DEBIAN/postinst" "$root/DEBIAN/prerm"
dpkg-deb --root-owner-group -Zgzip --build "$root" "$out/cohabit_${version}_${arch}.deb" >&2

# ---- cohabit-train ----
root="$stage/cohabit-train"
put 0755 "$bin_dir/cohabit-train" cohabit-train/usr/lib/cohabit-train/cohabit-train
strip --strip-debug "$root/usr/lib/cohabit-train/cohabit-train"
for lib in "$LIBTORCH"/lib/*.so*; do
    put 0644 "$lib" "cohabit-train/usr/lib/cohabit-train/$(basename "$lib")"
done
# libtorch is not a Debian package: the trainer finds the copy beside it.
cat >"$stage/wrapper" <<'EOF'
#!/bin/sh
LD_LIBRARY_PATH=/usr/lib/cohabit-train${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec /usr/lib/cohabit-train/cohabit-train "$@"
EOF
put 0755 "$stage/wrapper" cohabit-train/usr/bin/cohabit-train
trainer() { LD_LIBRARY_PATH="$root/usr/lib/cohabit-train" "$root/usr/lib/cohabit-train/cohabit-train" "$@"; }
trainer man | gzip -9n >"$stage/cohabit-train.1.gz"
put 0644 "$stage/cohabit-train.1.gz" cohabit-train/usr/share/man/man1/cohabit-train.1.gz
trainer completions bash >"$stage/t.bash"
put 0644 "$stage/t.bash" cohabit-train/usr/share/bash-completion/completions/cohabit-train
put 0644 "$stage/copyright" cohabit-train/usr/share/doc/cohabit-train/copyright
mkdir -p "$root/DEBIAN"
cat >"$root/DEBIAN/control" <<EOF
Package: cohabit-train
Version: $version
Architecture: $arch
Maintainer: cohabit developers <cohabit@example.invalid>
Depends: libc6 (>= 2.34), libgcc-s1, libstdc++6
Section: science
Priority: optional
Installed-Size: $(du -sk "$root" | cut -f1)
Description: offline training of cohabit's QoS models
 cohabit-train generates simulator data, reads cohabit's decision logs, fits and
 calibrates the models the cohabit daemon loads, and folds a fleet's per-host
 posteriors back into them. Ships the libtorch CPU libraries it links.
EOF
# A fast compression level: most of the size is libtorch, which compresses little.
dpkg-deb --root-owner-group -Zgzip -z1 --build "$root" "$out/cohabit-train_${version}_${arch}.deb" >&2
echo "$out/cohabit_${version}_${arch}.deb"
echo "$out/cohabit-train_${version}_${arch}.deb"
