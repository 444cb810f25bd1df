"""`python -m strata_rt.cli`: the same as the `strata` command."""

import sys

from . import main

sys.exit(main())
