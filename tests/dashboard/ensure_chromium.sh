#!/usr/bin/env bash
# Installs Debian's chromium when /usr/bin/chromium is missing (the headless dashboard test needs it).
# Called by `make test` before pytest; a no-op when chromium is already there. Exits 0 even when the
# install fails: the browser test then skips and says why.
set -uo pipefail
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null; then
    echo "ensure_chromium: /usr/bin/chromium missing and apt-get is not usable here (not root or not Debian)" >&2
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null 2>&1 || echo "ensure_chromium: apt-get update failed" >&2
apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null 2>&1 \
    || echo "ensure_chromium: apt-get install chromium failed" >&2
[ -x /usr/bin/chromium ] && /usr/bin/chromium --version || true
exit 0
