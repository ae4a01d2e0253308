"""python -m vramplan.cli: the same as the `vramplan` command."""
import sys

from vramplan.cli.main import main

sys.exit(main())
