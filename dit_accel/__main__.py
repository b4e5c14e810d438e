"""`python -m dit_accel ...` (and `torchrun ... -m dit_accel ...`): the `dit-accel` command line."""
import sys

try:
    from .cli import main
except KeyboardInterrupt:  # Ctrl-C before the command line is even read
    print("\ninterrupted", file=sys.stderr)
    sys.exit(130)

main()
