#!/usr/bin/env bash
# Installs Prometheus (server + promtool) from the distribution's packages when
# promtool is not already available. CI runs as root; elsewhere sudo is used if present.
set -euo pipefail

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
    echo "prometheus already installed: $(command -v prometheus), $(command -v promtool)"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-prometheus: need root (or sudo) to apt-get install prometheus" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# The Debian/Ubuntu package starts a service on install where systemd runs; in
# containers there is none, so only the binaries matter here.
$SUDO apt-get install -y -qq --no-install-recommends prometheus

command -v promtool >/dev/null 2>&1 || { echo "install-prometheus: promtool still missing" >&2; exit 1; }
prometheus --version | head -n 1
