#!/usr/bin/env bash
# Build CRIU 4.1.1 from Debian's copy of the upstream tarball and install it to
# /usr/local/sbin/criu. cairn's process mode needs CRIU >= 4 (4.0 brought the CUDA plugin) and
# bookworm ships 3.17; trixie's 4.1.1 binary needs trixie's libraries, so we build its source.
#
# Idempotent: does nothing when a criu >= 4 is installed and `criu check` says "Looks good".
# Non-interactive (no prompts, no stdin needed; fine under CI=true). Needs root (apt-get and
# /usr/local/sbin). The tarball is cached in .cache/criu (or $CAIRN_CRIU_CACHE).
set -euo pipefail

CRIU_VERSION=4.1.1
CRIU_SHA256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
TARBALL="criu_${CRIU_VERSION}.orig.tar.xz"
INSTALL_TO=/usr/local/sbin/criu
SOURCE_SUITE=trixie  # the Debian release that ships CRIU 4.1.1
# libprotobuf-dev provides google/protobuf/descriptor.proto, which CRIU's images/ symlinks to.
BUILD_DEPS=(libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler python3-protobuf
            libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev libnftables-dev
            pkg-config uuid-dev libaio-dev)

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${CAIRN_CRIU_CACHE:-$REPO/.cache/criu}"
START=$SECONDS
export DEBIAN_FRONTEND=noninteractive

say() { printf 'build_criu [%3ds]: %s\n' "$((SECONDS - START))" "$*"; }
die() { printf 'build_criu: error: %s\n' "$*" >&2; exit 1; }

# The criu binaries to judge: the one on PATH, then the one we install.
criu_candidates() {
    local c
    if c="$(command -v criu 2>/dev/null)"; then printf '%s\n' "$c"; fi
    if [[ -x "$INSTALL_TO" && "${c:-}" != "$INSTALL_TO" ]]; then printf '%s\n' "$INSTALL_TO"; fi
}

# "Version: 4.1.1" -> 4.1.1 (empty if unparseable).
criu_version() {
    "$1" --version </dev/null 2>/dev/null | sed -n 's/^Version:[[:space:]]*\([0-9][0-9.]*\).*/\1/p' | head -n1
}

# True when $1 is criu >= 4 and `criu check` passes on this kernel.
criu_good() {
    local bin="$1" version out
    version="$(criu_version "$bin")"
    [[ -n "$version" && "${version%%.*}" -ge 4 ]] || { say "$bin is version '${version:-unknown}' (< 4)"; return 1; }
    out="$("$bin" check </dev/null 2>&1)" || true
    if grep -q "Looks good" <<<"$out"; then
        say "$bin $version: criu check: Looks good"
        return 0
    fi
    say "$bin $version: criu check did not say 'Looks good':"
    printf '%s\n' "$out" | sed 's/^/    /' | tail -n 20
    return 1
}

while read -r bin; do
    if criu_good "$bin"; then say "nothing to do"; exit 0; fi
done < <(criu_candidates)

[[ "$(id -u)" -eq 0 ]] || die "building CRIU needs root (apt-get, $INSTALL_TO); run: sudo bash scripts/build_criu.sh"
command -v apt-get >/dev/null || die "apt-get not found; this script supports Debian/Ubuntu only (install CRIU >= 4 by hand and put it on PATH or set CAIRN_CRIU)"

# -- build dependencies ---------------------------------------------------------------------
APT_UPDATED=0
apt_update_once() {
    if [[ "$APT_UPDATED" -eq 0 ]]; then
        say "apt-get update"
        apt-get -o DPkg::Lock::Timeout=600 update -qq </dev/null
        APT_UPDATED=1
    fi
}

missing=()
for pkg in "${BUILD_DEPS[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
command -v gcc >/dev/null || missing+=(gcc libc6-dev)
command -v make >/dev/null || missing+=(make)
command -v xz >/dev/null || missing+=(xz-utils)
if ((${#missing[@]})); then
    apt_update_once
    say "installing build dependencies: ${missing[*]}"
    apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" </dev/null >/dev/null
else
    say "build dependencies already installed"
fi

# -- the source tarball ---------------------------------------------------------------------
mkdir -p "$CACHE"
cd "$CACHE"

sha_ok() { [[ -f "$TARBALL" ]] && echo "$CRIU_SHA256  $TARBALL" | sha256sum --check --status; }

if sha_ok; then
    say "using cached $CACHE/$TARBALL"
else
    rm -f "$TARBALL"
    # Reuse the mirror this machine already uses for Debian (deb822 or one-line format).
    mirror="$(sed -n 's/^URIs:[[:space:]]*\([^[:space:]]*\/debian\)\/\{0,1\}[[:space:]]*$/\1/p' \
                 /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1)"
    if [[ -z "$mirror" ]]; then
        mirror="$(sed -n 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\{0,1\}\([^[:space:]]*\/debian\)\/\{0,1\}[[:space:]].*/\2/p' \
                     /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -n1)"
    fi
    mirror="${mirror:-http://deb.debian.org/debian}"
    keyring=/usr/share/keyrings/debian-archive-keyring.gpg
    [[ -f "$keyring" ]] || die "$keyring missing; apt-get install debian-archive-keyring"

    # A private apt configuration (sources, lists, caches under $CACHE/apt) instead of a file in
    # /etc/apt/sources.list.d: the machine's apt state is never touched, so an interrupted run
    # leaves nothing behind and later `apt-get source` calls do not silently pick trixie.
    aptdir="$CACHE/apt"
    rm -rf "$aptdir"
    mkdir -p "$aptdir/sources.list.d" "$aptdir/lists/partial" "$aptdir/cache/archives/partial"
    cat >"$aptdir/sources.list.d/criu-src.sources" <<EOF
Types: deb-src
URIs: $mirror
Suites: $SOURCE_SUITE
Components: main
Signed-By: $keyring
EOF
    APT_OPTS=(-o "Dir::Etc::SourceList=/dev/null"
              -o "Dir::Etc::SourceParts=$aptdir/sources.list.d"
              -o "Dir::State::Lists=$aptdir/lists"
              -o "Dir::Cache=$aptdir/cache"
              -o "APT::Sandbox::User=root")
    say "fetching the $SOURCE_SUITE source index from $mirror"
    apt-get "${APT_OPTS[@]}" update -qq </dev/null
    version="$(apt-cache "${APT_OPTS[@]}" showsrc criu 2>/dev/null \
                 | sed -n "s/^Version:[[:space:]]*\(${CRIU_VERSION//./\\.}-[^[:space:]]*\)$/\1/p" | head -n1)"
    [[ -n "$version" ]] || die "$SOURCE_SUITE at $mirror has no criu $CRIU_VERSION source (apt-cache showsrc criu)"
    say "downloading criu $version source ($TARBALL)"
    rc=0
    apt-get "${APT_OPTS[@]}" source --download-only "criu=$version" </dev/null || rc=$?
    # apt-get may exit 100 having fetched the orig tarball but not every other file of the
    # source package (e.g. the .dsc); only the tarball matters, and its checksum decides.
    if [[ "$rc" -ne 0 ]]; then
        [[ -f "$TARBALL" ]] || die "apt-get source failed (exit $rc) and $TARBALL did not arrive"
        say "apt-get source exited $rc but $TARBALL arrived; checking its sha256"
    fi
    rm -rf "$aptdir"
    if ! sha_ok; then
        got="$(sha256sum "$TARBALL" | cut -d' ' -f1)"
        rm -f "$TARBALL"
        die "$TARBALL has sha256 $got, expected $CRIU_SHA256 (removed it; not building)"
    fi
    say "sha256 ok"
fi

# -- build and install ----------------------------------------------------------------------
src="$CACHE/criu-$CRIU_VERSION"
if [[ ! -f "$src/Makefile" ]]; then
    say "extracting into $src"
    rm -rf "$src"
    tar -xf "$TARBALL"
    [[ -f "$src/Makefile" ]] || die "$TARBALL did not extract to $src"
fi
jobs="$(nproc 2>/dev/null || echo 2)"
say "make -j$jobs criu (logs: $CACHE/build.log)"
if ! make -C "$src" -j"$jobs" criu >"$CACHE/build.log" 2>&1; then
    tail -n 40 "$CACHE/build.log" >&2
    die "make criu failed; full log in $CACHE/build.log"
fi
install -D -m 0755 "$src/criu/criu" "$INSTALL_TO"
say "installed $INSTALL_TO ($("$INSTALL_TO" --version | head -n1))"

# An older criu earlier on PATH (e.g. bookworm's /usr/sbin/criu) would shadow ours.
if on_path="$(command -v criu 2>/dev/null)" && [[ "$on_path" != "$INSTALL_TO" ]]; then
    say "warning: $on_path comes before $INSTALL_TO on PATH; cairn prefers \$CAIRN_CRIU, then PATH"
fi

criu_good "$INSTALL_TO" || die "criu check failed on this kernel (see above); process mode cannot work here"
say "done"
