"""The environment of an engine pod: the variables the operator sets in every rank's container
that the engine reads. Standard library only, append-only (pods of an older release read what a
newer operator sets).

A rank learns its place in its group from its command line (`--node-rank`, `--nnodes`,
`--master-addr`, `--master-port`: vLLM's flag names, which stock `vllm serve` reads too), not
from the environment; only what has no flag is passed here.
"""

from __future__ import annotations

# Where the engine writes its termination message (shoal.contract.termination reads it; the
# operator sets it to the container's terminationMessagePath).
TERMINATION_LOG = "SHOAL_TERMINATION_LOG"
