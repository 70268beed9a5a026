"""`python -m hamburger.cli ...`: the same as the `hamburger` console script."""

import sys

from hamburger.cli import main

sys.exit(main())
