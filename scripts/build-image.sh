#!/usr/bin/env bash
# Builds the node agent's OCI image from the `cohabit` Debian package, without pulling a
# base image: a root file system of the package's files plus the C libraries the binary
# links (copied from this Debian host, which built it), then `podman build` with
# deploy/container/Containerfile (FROM scratch).
#
#   scripts/build-image.sh DEB [TAG]       (TAG defaults to cohabit:VERSION, as the DaemonSet names it)
#
# To run it on a cluster, push it where the nodes pull from and point the DaemonSet at it:
#   podman tag cohabit:0.1.0 registry.example.com/ops/cohabit:0.1.0
#   podman push registry.example.com/ops/cohabit:0.1.0
set -euo pipefail
cd "$(dirname "$0")/.."
deb="${1:?usage: scripts/build-image.sh DEB [TAG]}"
version=$(dpkg-deb --field "$deb" Version)
tag="${2:-cohabit:$version}"
command -v podman >/dev/null || { echo "build-image.sh: podman is missing (apt install podman)" >&2; exit 1; }
context=$(mktemp -d)
trap 'rm -rf "$context"' EXIT
rootfs="$context/rootfs"
dpkg-deb -x "$deb" "$rootfs"
# The libraries the binary links and the loader, by their resolved paths.
ldd "$rootfs/usr/bin/cohabit" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\/.*ld-linux/ { print $1 }' |
    while read -r lib; do
        install -D -m 0755 "$(readlink -f "$lib")" "$rootfs$lib"
    done
# Users for the matchers' name lookups (the host's own /etc is not mounted in).
install -d "$rootfs/etc" "$rootfs/tmp" "$rootfs/run/cohabit" "$rootfs/var/log/cohabit"
printf 'root:x:0:0:root:/root:/usr/sbin/nologin\n' >"$rootfs/etc/passwd"
printf 'root:x:0:\n' >"$rootfs/etc/group"
cp deploy/container/Containerfile "$context/Containerfile"
podman build --quiet --network none -t "$tag" -f "$context/Containerfile" "$context" >&2
echo "$tag"
