#!/usr/bin/env bash
# Chromium for the dashboard's browser tests: Playwright for Python (the test extra) drives the
# system's browser, since it cannot download its own here. Installs Debian's `chromium` if missing
# and prints the export that makes those tests fail, rather than skip, without a browser:
#
#   eval "$(.ci/chromium.sh)"
set -euo pipefail
log() { echo "chromium.sh: $*" >&2; }
if ! command -v chromium >/dev/null 2>&1; then
  log "installing chromium from Debian packages"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq chromium >&2
fi
command -v chromium >/dev/null 2>&1 || { log "no chromium after install"; exit 1; }
log "$(chromium --version 2>/dev/null | head -n 1)"
echo "export MINT_REQUIRE_BROWSER=1"
