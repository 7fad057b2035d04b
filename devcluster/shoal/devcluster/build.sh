#!/usr/bin/env bash
# Build Kubernetes from Debian bookworm's `kubernetes` source package, once per cache.
#
#   build.sh [control-plane] [node]      (no argument: control-plane; `all`: both)
#   build.sh packages                    (only what nodes and image builds need at run time)
#
#   control-plane: kube-apiserver, kube-controller-manager (what the operator's tests need)
#   node:          kubelet, kube-scheduler, kube-proxy and a static `pause` binary (what
#                  the cluster with real nodes needs: python -m shoal.devcluster)
#
# Both sets come from the same source tree: when both are asked for, the tree is unpacked once.
#
# Why from Debian sources: the test machines reach only PyPI/Debian/npm, have no cluster and no
# container runtime, yet the operator's tests need a real API server (schema validation, garbage
# collection, StatefulSet controller, watches for kopf). Debian ships the whole Kubernetes tree
# with vendor/, so a GOPATH build works offline.
#
# Output: ${SHOAL_CACHE:-$HOME/.cache/shoal}/k8s/bin/*, one stamp per set (stamp, node-stamp).
# Idempotent: reuses the cache when a set's stamp matches; a flock serialises concurrent callers.
# Runs as root (apt-get). Prints one progress line per step on stderr.
set -euo pipefail

# Debian revisions (security updates, e.g. -1.1+deb12u1) are accepted; the upstream part is pinned.
K8S_SRC_VERSION="1.20.5+really1.20.2"
K8S_GIT_VERSION="v1.20.2"
# Bump when the recipe changes so that old caches are rebuilt.
RECIPE=2
STAMP_TEXT="kubernetes ${K8S_SRC_VERSION} ${K8S_GIT_VERSION} recipe=${RECIPE} reflect2+json-iterator swapped from Debian"
NODE_RECIPE=1
NODE_STAMP_TEXT="kubernetes ${K8S_SRC_VERSION} ${K8S_GIT_VERSION} node recipe=${NODE_RECIPE} reflect2+json-iterator swapped from Debian"
CP_CMDS=(kube-apiserver kube-controller-manager)
NODE_CMDS=(kubelet kube-scheduler kube-proxy)

WANT_CP=0
WANT_NODE=0
ONLY_PACKAGES=0
[ $# -eq 0 ] && WANT_CP=1
for arg in "$@"; do
    case "$arg" in
        control-plane) WANT_CP=1 ;;
        node) WANT_NODE=1 ;;
        all) WANT_CP=1; WANT_NODE=1 ;;
        packages) WANT_NODE=1; ONLY_PACKAGES=1 ;;
        *) echo "usage: $0 [control-plane] [node] | all | packages" >&2; exit 2 ;;
    esac
done

CACHE_ROOT="${SHOAL_CACHE:-$HOME/.cache/shoal}"
K8S_CACHE="${CACHE_ROOT}/k8s"
BIN_DIR="${K8S_CACHE}/bin"
STAMP="${K8S_CACHE}/stamp"
NODE_STAMP="${K8S_CACHE}/node-stamp"
WORK="${K8S_CACHE}/build"          # source tree + GOPATH; removed after a successful build
KEEP_WORK="${SHOAL_K8S_KEEP_BUILD:-0}"
GO_PARALLEL="${SHOAL_K8S_BUILD_JOBS:-$(nproc)}"

RUNTIME_PKGS=(etcd-server openssl)
BUILD_PKGS=(golang-1.19-go dpkg-dev golang-github-modern-go-reflect2-dev
            golang-github-json-iterator-go-dev ca-certificates)
# gcc + static libc for the pause binary (node set only).
NODE_BUILD_PKGS=(gcc libc6-dev)
# What a node and the images need at run time (cluster.py): installed whenever `node` is asked
# for, even on a warm cache (a cache restored onto a fresh machine).
NODE_RUNTIME_PKGS=(containerd runc containernetworking-plugins iptables conntrack dnsmasq-base
                   buildah podman debootstrap)
SRC_LIST=/etc/apt/sources.list.d/shoal-bookworm-src.sources

T0=$(date +%s)
log() { echo "[k8s-build +$(( $(date +%s) - T0 ))s] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

missing_pkgs() {
    local p
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || echo "$p"
    done
}

APT_UPDATED=0
apt_install() {
    local missing
    missing=$(missing_pkgs "$@")
    [ -z "$missing" ] && return 0
    [ "$(id -u)" = 0 ] || die "need root to install: $missing"
    if [ "$APT_UPDATED" = 0 ]; then
        log "apt-get update"
        apt-get update -qq >&2 || die "apt-get update failed"
        APT_UPDATED=1
    fi
    log "apt-get install $missing"
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >&2 \
        || die "apt-get install failed: $missing"
}

cp_cache_ok() {
    [ -x "${BIN_DIR}/kube-apiserver" ] && [ -x "${BIN_DIR}/kube-controller-manager" ] \
        && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$STAMP_TEXT" ]
}

node_cache_ok() {
    local b
    for b in "${NODE_CMDS[@]}" pause; do [ -x "${BIN_DIR}/${b}" ] || return 1; done
    [ -f "$NODE_STAMP" ] && [ "$(cat "$NODE_STAMP")" = "$NODE_STAMP_TEXT" ]
}

mkdir -p "$K8S_CACHE"
exec 9>"${K8S_CACHE}/.lock"
if ! flock -n 9; then
    log "another build holds ${K8S_CACHE}/.lock; waiting"
    flock 9
fi

# Runtime packages are needed even with a warm cache (a cache restored onto a fresh machine).
apt_install "${RUNTIME_PKGS[@]}"
[ "$WANT_NODE" = 1 ] && apt_install "${NODE_RUNTIME_PKGS[@]}"
command -v etcd >/dev/null || die "etcd not on PATH after installing etcd-server"
# `packages`: cluster.py builds the images (debootstrap, buildah) while the binaries compile.
[ "$ONLY_PACKAGES" = 1 ] && exit 0

BUILD_CP=0
BUILD_NODE=0
if [ "$WANT_CP" = 1 ]; then
    if cp_cache_ok; then log "cache hit: ${BIN_DIR} ($(cat "$STAMP"))"; else BUILD_CP=1; fi
fi
if [ "$WANT_NODE" = 1 ]; then
    if node_cache_ok; then log "cache hit: ${BIN_DIR} ($(cat "$NODE_STAMP"))"; else BUILD_NODE=1; fi
fi
[ "$BUILD_CP" = 0 ] && [ "$BUILD_NODE" = 0 ] && exit 0

log "cache miss: building into ${K8S_CACHE} (free disk: $(df -h --output=avail "$CACHE_ROOT" | tail -1 | tr -d ' '))"
avail_kb=$(df -k --output=avail "$CACHE_ROOT" | tail -1)
[ "$avail_kb" -gt $((6 * 1024 * 1024)) ] || die "need >= 6 GiB free under $CACHE_ROOT for the build"

apt_install "${BUILD_PKGS[@]}"
[ "$BUILD_NODE" = 1 ] && apt_install "${NODE_BUILD_PKGS[@]}"

# A private deb-src entry for bookworm main, on the same mirror as the machine's deb sources.
if [ ! -f "$SRC_LIST" ]; then
    mirror=$(awk '/^URIs:/ && $2 ~ /debian\/?$/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    if [ -z "$mirror" ]; then
        mirror=$(awk '$1=="deb" && $3 ~ /^bookworm$/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    fi
    mirror=${mirror:-http://deb.debian.org/debian}
    log "adding deb-src ${mirror} bookworm main -> ${SRC_LIST}"
    cat >"$SRC_LIST" <<EOF
Types: deb-src
URIs: ${mirror}
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    APT_UPDATED=0
fi
if [ "$APT_UPDATED" = 0 ]; then
    log "apt-get update (for deb-src)"
    apt-get update -qq >&2 || die "apt-get update failed"
    APT_UPDATED=1
fi

export GOROOT=/usr/lib/go-1.19
export PATH="${GOROOT}/bin:${PATH}"
export GOPATH="${WORK}/gopath"
export GOCACHE="${WORK}/gocache"
export GO111MODULE=off GOPROXY=off GOFLAGS= CGO_ENABLED=0
go version >/dev/null || die "go 1.19 not found at ${GOROOT}"

SRC_DIR="${WORK}/src"
TREE="${GOPATH}/src/k8s.io/kubernetes"
mkdir -p "$SRC_DIR" "$(dirname "$TREE")"

if [ ! -f "${WORK}/.fetched" ]; then
    deb_version=$(apt-cache showsrc kubernetes 2>/dev/null \
        | awk -v up="$K8S_SRC_VERSION" '/^Version:/ && index($2, up"-") == 1 {print $2; exit}')
    [ -n "$deb_version" ] || die "no source package kubernetes ${K8S_SRC_VERSION}-* in the deb-src lists"
    log "apt-get source kubernetes=${deb_version}"
    rm -rf "$SRC_DIR" "$TREE"
    mkdir -p "$SRC_DIR"
    (cd "$SRC_DIR" && apt-get source -qq "kubernetes=${deb_version}" >&2) \
        || die "apt-get source kubernetes=${deb_version} failed"
    unpacked="${SRC_DIR}/kubernetes-${K8S_SRC_VERSION}"
    [ -d "$unpacked" ] || die "apt-get source did not unpack ${unpacked}"
    mv "$unpacked" "$TREE"
    rm -rf "$SRC_DIR"
    touch "${WORK}/.fetched"
fi
cd "$TREE"
[ -d vendor ] || die "the source tree has no vendor/ directory"

if [ ! -f "${WORK}/.swapped" ]; then
    # The vendored reflect2 1.0.1 crashes (unsafe map access) under go >= 1.18 on the first
    # custom-resource POST; Debian's patched reflect2/json-iterator fix it.
    for pair in "github.com/modern-go/reflect2" "github.com/json-iterator/go"; do
        src="/usr/share/gocode/src/${pair}"
        [ -d "$src" ] || die "missing ${src} (Debian package not installed?)"
        log "vendor swap: ${pair} <- ${src}"
        rm -rf "vendor/${pair}"
        mkdir -p "vendor/${pair}"
        cp -rL "${src}/." "vendor/${pair}/"
        find "vendor/${pair}" -name '*_test.go' -delete
    done
    touch "${WORK}/.swapped"
fi

OPENAPI_OUT=pkg/generated/openapi/zz_generated.openapi.go
# Only the API server and controller manager link the generated OpenAPI definitions.
if [ "$BUILD_CP" = 1 ] && { [ ! -s "$OPENAPI_OUT" ] || [ ! -f "${WORK}/.openapi" ]; }; then
    log "building openapi-gen"
    go build -o "${WORK}/openapi-gen" ./vendor/k8s.io/kube-openapi/cmd/openapi-gen \
        || die "building openapi-gen failed"
    log "collecting packages tagged +k8s:openapi-gen="
    # Same selection as build/root/Makefile.generated_files: every directory with the tag,
    # staging packages seen through vendor/ (their import path in this GOPATH tree).
    inputs=$(grep -rl --include='*.go' -e '+k8s:openapi-gen=' \
                 pkg cmd plugin staging/src/k8s.io 2>/dev/null \
             | grep -v -e '_test.go$' -e '/_' -e '/testdata/' | xargs -n1 dirname | LC_ALL=C sort -u \
             | sed -e 's#^staging/src/#k8s.io/kubernetes/vendor/#' -e 't' -e 's#^#k8s.io/kubernetes/#' \
             | paste -sd, -)
    [ -n "$inputs" ] || die "no +k8s:openapi-gen= packages found"
    log "generating ${OPENAPI_OUT} from $(echo "$inputs" | tr ',' '\n' | wc -l) packages"
    "${WORK}/openapi-gen" --logtostderr -v 1 \
        -i "$inputs" \
        -p k8s.io/kubernetes/pkg/generated/openapi \
        -O zz_generated.openapi \
        -h hack/boilerplate/boilerplate.generatego.txt \
        -r "${WORK}/openapi-violations.report" \
        -o "${GOPATH}/src" >"${WORK}/openapi-gen.log" 2>&1 \
        || { tail -20 "${WORK}/openapi-gen.log" >&2; die "openapi-gen failed"; }
    [ -s "$OPENAPI_OUT" ] || die "openapi-gen produced no ${OPENAPI_OUT}"
    touch "${WORK}/.openapi"
fi

# Version stamps: component-base (what `--version` prints) and client-go's copy (what the
# /version endpoint reports); without them the server says v0.0.0-master, which trips version
# checks such as helm's kubeVersion.
LDFLAGS="-s -w"
for pkg in k8s.io/kubernetes/vendor/k8s.io/component-base/version \
           k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
    LDFLAGS="${LDFLAGS} -X ${pkg}.gitVersion=${K8S_GIT_VERSION} -X ${pkg}.gitMajor=1 \
-X ${pkg}.gitMinor=20 -X ${pkg}.gitTreeState=clean -X ${pkg}.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
done
mkdir -p "${WORK}/out" "$BIN_DIR"
CMDS=()
[ "$BUILD_CP" = 1 ] && CMDS+=("${CP_CMDS[@]}")
[ "$BUILD_NODE" = 1 ] && CMDS+=("${NODE_CMDS[@]}")
for cmd in "${CMDS[@]}"; do
    t=$(date +%s)
    log "go build ./cmd/${cmd} (-p ${GO_PARALLEL}, niced)"
    nice -n 10 go build -p "$GO_PARALLEL" -trimpath -ldflags "$LDFLAGS" \
        -o "${WORK}/out/${cmd}" "./cmd/${cmd}" || die "go build ./cmd/${cmd} failed"
    log "built ${cmd} in $(( $(date +%s) - t ))s"
done

if [ "$BUILD_NODE" = 1 ]; then
    # The pod sandbox's PID 1, from the same tree (build/pause), static so that an image
    # holding only this file runs.
    log "gcc build/pause/linux/pause.c -> pause"
    gcc -Os -static -Wall -Werror -DVERSION=v3.4.1-shoal -o "${WORK}/out/pause" \
        build/pause/linux/pause.c || die "building pause failed"
    strip "${WORK}/out/pause" || true
    CMDS+=(pause)
fi

for cmd in "${CMDS[@]}"; do
    install -m 0755 "${WORK}/out/${cmd}" "${BIN_DIR}/${cmd}.new"
    mv -f "${BIN_DIR}/${cmd}.new" "${BIN_DIR}/${cmd}"
done
if [ "$BUILD_CP" = 1 ]; then
    reported=$("${BIN_DIR}/kube-apiserver" --version) || die "built kube-apiserver does not run"
    [ "$reported" = "Kubernetes ${K8S_GIT_VERSION}" ] \
        || die "built kube-apiserver reports '${reported}', expected 'Kubernetes ${K8S_GIT_VERSION}'"
    log "built: ${reported}"
    echo "$STAMP_TEXT" >"$STAMP"
fi
if [ "$BUILD_NODE" = 1 ]; then
    reported=$("${BIN_DIR}/kubelet" --version) || die "built kubelet does not run"
    [ "$reported" = "Kubernetes ${K8S_GIT_VERSION}" ] \
        || die "built kubelet reports '${reported}', expected 'Kubernetes ${K8S_GIT_VERSION}'"
    log "built: kubelet ${reported}, kube-scheduler, kube-proxy, pause"
    echo "$NODE_STAMP_TEXT" >"$NODE_STAMP"
fi
echo "$(( $(date +%s) - T0 ))" >"${K8S_CACHE}/build-seconds"

if [ "$KEEP_WORK" = 1 ]; then
    log "keeping build tree ${WORK} (SHOAL_K8S_KEEP_BUILD=1)"
else
    log "removing build tree ${WORK}"
    cd /
    rm -rf "$WORK"
fi
log "done: $(du -sh "$K8S_CACHE" | cut -f1) in ${K8S_CACHE}"
