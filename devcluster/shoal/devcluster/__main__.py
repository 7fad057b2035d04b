"""`python -m shoal.devcluster`: see cli.py."""

import sys

from shoal.devcluster.cli import main

sys.exit(main())
