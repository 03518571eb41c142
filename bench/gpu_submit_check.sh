#!/usr/bin/env bash
# Issue 34's device run: install the wheels in .whl/ (what the GPU machine's venv lacks: submitit,
# pydantic, deepspeed, py-spy, setproctitle, ...) into /tmp/site, then bench/gpu_submit_check.py.
# Usage, from the repository root:  bash bench/gpu_submit_check.sh OUT_DIR [gpu_submit_check.py options]
set -u
out=${1:?usage: bench/gpu_submit_check.sh OUT_DIR [options]}
shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD" PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
exec python3 bench/gpu_submit_check.py --out "$out" "$@"
