#!/usr/bin/env bash
# Install loraplex into ./.venv and serve the default model on embedded defaults
# (SQLite + blob directory under LORAPLEX_HOME, a `demo` tenant whose key is printed once).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/loraplex serve "$@"
