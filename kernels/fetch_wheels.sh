#!/usr/bin/env bash
# Wheels the GPU machine's image lacks for the end-to-end part of gpu_check.py (loraplex.config
# needs pydantic-settings; the image has torch, triton, transformers, peft, safetensors).
# Run here, from the repository root, before a device call; then carry `.whl` (see README.md).
set -euo pipefail
dest="${1:-.whl}"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
py="$(command -v python3)"
[ -x .venv/bin/python ] && py=.venv/bin/python
"$py" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" \
  pydantic==2.14.4 pydantic_core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
  typing-inspection==0.4.5 annotated-types==0.8.0 typing_extensions==4.16.0
ls -la "$dest"
