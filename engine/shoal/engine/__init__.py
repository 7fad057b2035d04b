"""Shoal's serving engine.

Importing this package must stay cheap and torch-free: the operator image installs it (for the
wire protocol and the termination-message format) without torch. Heavy modules are imported
where they are used.
"""

__version__ = "0.1.0"
