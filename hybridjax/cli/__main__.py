"""`python -m hybridjax.cli ...`: the same as the `hybridjax` command."""

import sys

from hybridjax.cli import main

sys.exit(main())
