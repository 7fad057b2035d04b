#!/usr/bin/env bash
# Start a local control plane (etcd + kube-apiserver + kube-controller-manager) for debugging.
#   start.sh DIR               start detached; state, certs, logs and kubeconfig under DIR
#   start.sh DIR --foreground  stay attached; Ctrl-C stops everything
#   start.sh --stop DIR        stop the one started detached in DIR
# Then: kubectl --kubeconfig DIR/kubeconfig get ns
# Builds the binaries first (build.sh) if the cache lacks them.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${PYTHON:-python3}"
if [ "${1:-}" = "--stop" ]; then
    [ $# -eq 2 ] || { echo "usage: $0 --stop DIR" >&2; exit 2; }
    exec "$py" "$here/control_plane.py" stop "$2"
fi
[ $# -ge 1 ] || { echo "usage: $0 DIR [--foreground] | $0 --stop DIR" >&2; exit 2; }
exec "$py" "$here/control_plane.py" start "$@"
