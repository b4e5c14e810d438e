#!/usr/bin/env bash
# Creates .venv and installs dit-accel with its kernels, generate and test extras. Idempotent: a second run
# only checks.
#   bash scripts/setup.sh            # then .venv/bin/dit-accel ... or .venv/bin/python -m pytest
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
gpu=false
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then gpu=true; fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if $gpu; then
    "${pip[@]}" "torch>=2.8"  # pip's default build, with CUDA and the Triton it was built with
  else
    "${pip[@]}" "torch==2.13.0"  # the version the CPU tests run with; pip takes a CPU build where one is offered
  fi
fi
"${pip[@]}" -e ".[kernels,generate,test]"
# Without a GPU, torch comes without Triton; the FP8 prep's kernels then run in Triton's interpreter in the
# tests, at the version the GPU machines run (a GPU build of torch brings its own Triton).
if ! $gpu && ! .venv/bin/python -c "import triton" 2>/dev/null; then
  "${pip[@]}" "triton==3.6.0"
fi
.venv/bin/python -c "import dit_accel, dit_accel.kernels, torch; print('dit-accel', dit_accel.__version__, '| torch', torch.__version__, '| CUDA', torch.cuda.is_available())"
