"""The contracts between Shoal's components: what the operator, the routers and the engine agree
on, in one place each, so that no side re-types a key, a label or a format.

Rules (the same as for the engine's wire module): standard library only, no torch and no kopf,
so every image can import it; append-only (a released key or value is never renamed or
removed: pods of an older release read what a newer operator writes); every name documented.

Modules:
- `labels`: the API group and kind, the labels and ports every child object carries.
- `discovery`: the ready-groups document the operator writes and the routers read.
- `routing`: routing policy names and the environment that selects them.
- `termination`: the termination message a dying engine writes and the operator reads.
- `env`: the environment the operator sets in engine pods for the engine to read.
- `auth`: which API keys a server accepts (flag, `SHOAL_API_KEY`, `VLLM_API_KEY`) and the check.

Components import each other only through this package (enforced by import-linter,
`[tool.importlinter]` in pyproject.toml).
"""

__version__ = "0.1.0"  # the release every component and image of this tree is built as
