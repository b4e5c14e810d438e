"""`python -m dit_accel ...` (and `torchrun ... -m dit_accel ...`): the `dit-accel` command line."""
import os
import sys

# `python -m` puts the working directory first on sys.path. In this repository's root, its kernels/ folder (our
# kernels, installed as dit_accel.kernels) would then shadow Hugging Face's `kernels` package, which transformers
# imports (a dependency of it since transformers 5.25). The command line imports nothing from the working directory.
if sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C before the command line is even read
    print("\ninterrupted", file=sys.stderr)
    sys.exit(130)

main()
