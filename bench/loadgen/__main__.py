"""`python -m bench.loadgen ...`: the same as `pdserve bench ...`."""

import sys

from bench.loadgen.cli import main

sys.exit(main())
