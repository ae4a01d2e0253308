"""`python -m vramplan`: the same command as the `vramplan` script."""
import sys

from vramplan.cli import main

if __name__ == "__main__":
    sys.exit(main())
