#!/usr/bin/env bash
# Builds the Debian packages and the node-agent image, installs the packages on this
# machine, runs the installed binaries, verifies the systemd unit, runs the image once with
# the DaemonSet's mounts, and removes everything again. For CI (root, a disposable
# machine): .ci/run sets COHABIT_CHECK_PACKAGES=1 and scripts/test.sh then runs this.
#
#   scripts/check-package.sh [--profile dev|release]    (default dev: the test build's binaries)
set -euo pipefail
cd "$(dirname "$0")/.."
profile=dev
[ "${1:-}" = --profile ] && profile="$2"
[ "$(id -u)" = 0 ] || { echo "check-package.sh: needs root (it installs the packages)" >&2; exit 1; }
for pkg in cohabit cohabit-train; do
    if dpkg-query -W -f '${Status}' "$pkg" 2>/dev/null | grep -q installed; then
        echo "check-package.sh: $pkg is installed here already; not replacing it" >&2
        exit 1
    fi
done
scripts/build-deb.sh --profile "$profile" --out target/deb >target/deb.list
mapfile -t debs <target/deb.list
tag=""
cleanup() {
    dpkg --purge cohabit cohabit-train >/dev/null 2>&1 || true
    [ -n "$tag" ] && podman rmi -f "$tag" >/dev/null 2>&1 || true
    rm -rf /run/cohabit-image-check
}
trap cleanup EXIT
dpkg -i "${debs[@]}" >/dev/null
echo "installed: $(dpkg-query -W cohabit cohabit-train | tr '\t\n' '  ')"
# The package is the full daemon, node agent included (scripts/build-deb.sh).
version=$(/usr/bin/cohabit --version)
echo "$version"
grep -q 'with the Kubernetes node agent' <<<"$version"
/usr/bin/cohabit probe >/dev/null
/usr/bin/cohabit-train --version
test -s /usr/share/man/man1/cohabit.1.gz
test -s /usr/share/bash-completion/completions/cohabit
test -s /usr/share/cohabit/models/default/qos-v1.json
grep -qx /etc/cohabit/cohabit.toml /var/lib/dpkg/info/cohabit.conffiles
if command -v systemd-analyze >/dev/null; then
    systemd-analyze verify /lib/systemd/system/cohabit.service
    echo "systemd-analyze verify: cohabit.service ok"
else
    echo "systemd-analyze is not here: the unit was not verified" >&2
fi
if command -v podman >/dev/null; then
    tag=$(scripts/build-image.sh "${debs[0]}")
    mkdir -p /run/cohabit-image-check
    # The DaemonSet's mounts: the cgroup and resctrl trees under /host, the state directory.
    mounts=(-v /sys/fs/cgroup:/host/sys/fs/cgroup -v /run/cohabit-image-check:/run/cohabit)
    [ -d /sys/fs/resctrl ] && mounts+=(-v /sys/fs/resctrl:/host/sys/fs/resctrl)
    # runc where it is here: crun refuses hosts whose cgroup2 mount lists controllers beside
    # v1 hierarchies ("hybrid mode"), as the project's VMs do. Limits below this machine's hard ones: podman's
    # defaults (and --ulimit host) ask for more than an unprivileged hard limit allows.
    runtime=()
    command -v runc >/dev/null || [ -x /usr/sbin/runc ] && runtime=(--runtime runc)
    out=$(podman "${runtime[@]}" run --rm --pull never --ulimit nofile=4096:4096 --ulimit nproc=4096:4096 --privileged \
        --network host --read-only "${mounts[@]}" "$tag" probe)
    grep -q . <<<"$out"
    echo "image $tag: cohabit probe ran inside ($(wc -l <<<"$out") lines)"
else
    echo "podman is not here: the image was not built" >&2
fi
dpkg --remove cohabit cohabit-train >/dev/null
test ! -e /usr/bin/cohabit
test -e /etc/cohabit/cohabit.toml # a conffile outlives remove, until purge
echo "removed; the conffile stays until purge"
