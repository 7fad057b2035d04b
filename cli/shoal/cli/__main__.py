"""`python -m shoal.cli ...` is `shoal ...`."""

import sys

from shoal.cli import main

sys.exit(main())
