"""`python -m loadgen ...`: the same as `pdserve bench ...`."""

import sys

from loadgen.cli import main

sys.exit(main())
