#!/usr/bin/env bash
# Make a headless Chromium available for the report's browser test (tests/browser). Idempotent:
# with a browser already there it installs nothing. Otherwise it apt-installs Debian's `chromium`
# (as root, or through sudo), and fails with what to do when it cannot.
#
#   bash scripts/setup_browser.sh      # MRL_CHROMIUM=/path/to/chrome: use that one, install nothing
set -euo pipefail

if [ -n "${MRL_CHROMIUM:-}" ]; then
  if [ -x "$MRL_CHROMIUM" ]; then
    echo "setup_browser: MRL_CHROMIUM=$MRL_CHROMIUM (nothing to install)"
    exit 0
  fi
  echo "setup_browser: MRL_CHROMIUM=$MRL_CHROMIUM is not an executable; fix: point it at a Chrome/Chromium binary or unset it" >&2
  exit 1
fi

# The names tests/browser/test_report_browser.py looks for, in the same order.
find_browser() {
  for name in chromium chromium-browser google-chrome google-chrome-stable; do
    command -v "$name" && return 0
  done
  return 1
}

if browser=$(find_browser); then
  echo "setup_browser: $browser is installed (nothing to install)"
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "setup_browser: no Chromium and no apt-get; fix: install Chromium or Chrome, or set MRL_CHROMIUM to its binary" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null || { echo "setup_browser: installing chromium needs root; fix: sudo apt-get install chromium, or set MRL_CHROMIUM" >&2; exit 1; }
  SUDO="sudo"
fi
echo "setup_browser: installing chromium with apt-get (for the report's browser test)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
browser=$(find_browser) || { echo "setup_browser: apt-get installed chromium but no browser command is on PATH; fix: set MRL_CHROMIUM" >&2; exit 1; }
echo "setup_browser: done ($browser)"
