# Sourced by the scripts/install_*.sh scripts: one way to install Debian packages for the tests.
#
#   install_debian_packages WHO SKIPPED SERVICES PACKAGE...
#
# Installs the PACKAGEs that are missing (idempotent), waiting up to 10 min for the dpkg lock
# another apt-get may hold. WHO names the caller in its messages; SKIPPED says what skips when
# it cannot install (not root, no apt-get: a note, exit status 0). SERVICES is "start" or
# "no-services": with the latter a policy-rc.d keeps the packages' maintainer scripts from
# starting their services (the tests start their own daemons); only a policy file created here
# is removed again.
install_debian_packages() {
    local who=$1 skipped=$2 services=$3
    shift 3
    local packages=("$@") missing=() pkg
    if [[ "$(id -u)" -ne 0 ]]; then
        echo "$who: not root: ${packages[*]} not installed; $skipped"
        return 0
    fi
    if ! command -v apt-get >/dev/null; then
        echo "$who: no apt-get; install ${packages[*]} by hand"
        return 0
    fi
    for pkg in "${packages[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" \
            || missing+=("$pkg")
    done
    if ((${#missing[@]} == 0)); then
        echo "$who: ${packages[*]} already installed"
        return 0
    fi
    echo "$who: installing ${missing[*]}"
    local policy=/usr/sbin/policy-rc.d created_policy=0 status=0
    if [[ "$services" == no-services && ! -e "$policy" ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && created_policy=1
    fi
    {
        apt-get -o DPkg::Lock::Timeout=600 update -qq </dev/null \
            && apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
                "${missing[@]}" </dev/null >/dev/null
    } || status=$?
    if ((created_policy)); then rm -f "$policy"; fi
    return "$status"
}
