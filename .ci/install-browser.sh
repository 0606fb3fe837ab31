#!/usr/bin/env bash
# Headless Chromium and chromedriver (Debian packages) for the dashboard's browser test,
# tests/dashboard_app/test_browser.py. Idempotent; runs as root (as CI does) or through sudo.
set -euo pipefail

if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
# Another apt may hold the lock for a while (e.g. a parallel set-up step): wait, then retry.
APT_OPTS=(-q -o DPkg::Lock::Timeout=300)
for attempt in 1 2 3; do
    if $SUDO apt-get "${APT_OPTS[@]}" update && $SUDO apt-get "${APT_OPTS[@]}" install -y chromium chromium-driver; then
        break
    fi
    if [ "$attempt" -eq 3 ]; then
        echo "install-browser.sh: could not install chromium and chromium-driver" >&2
        exit 1
    fi
    sleep 20
done
/usr/bin/chromium --version
/usr/bin/chromedriver --version
