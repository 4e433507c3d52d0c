#!/usr/bin/env bash
# Set up everything the test suite needs on a fresh machine, then run the whole suite.
# System packages (PostgreSQL server binaries, Debian's Chromium) are installed with apt-get
# when missing; Playwright drives Debian's Chromium (its own browser download does not work here).
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  need_apt+=(postgresql)
fi
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need_apt[@]}" >/dev/null
  else
    echo "warning: missing system packages (${need_apt[*]}); install them with apt-get as root" >&2
  fi
fi

bash scripts/install.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider --timeout=900 --durations=25 "$@"
