"""`python -m shoal.engine.core.engine_core_proc SPEC_JSON`: how the frontend starts an engine."""

import sys

from shoal.engine.core.engine_core_proc.proc import main

sys.exit(main())
