#!/usr/bin/env bash
# Creates .venv and installs dit-accel with its kernels, generate and test extras. Idempotent: a second run
# only checks. Without a GPU it takes the CPU build of torch where one is at hand.
#   bash scripts/setup.sh            # then .venv/bin/dit-accel ... or .venv/bin/python -m pytest
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[[ -x .venv/bin/python ]] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" "torch>=2.8"
  else
    # 2.13.0 is the CPU build kept on this workplace's machines; elsewhere pip fetches it from PyPI.
    "${pip[@]}" "torch==2.13.0"
  fi
fi
"${pip[@]}" -e ".[kernels,generate,test]"
.venv/bin/python -c "import dit_accel, dit_accel.kernels, torch; print('dit-accel', dit_accel.__version__, '| torch', torch.__version__, '| CUDA', torch.cuda.is_available())"
