"""Every third-party module the shipped code imports is a direct requirement of the extra that
installs that code (`shoal[engine]` for engine/, `shoal[router]` for router/, `shoal[operator]`
for operator/; contract/ and cli/ ship in every image, so the base install must cover them).

Why: the frontend image crashed at start with `ModuleNotFoundError: httpx` because the router
imported httpx and only the test extra installed it; the development venv (`.[all]`) hid it.
Relying on a dependency's dependencies hides the same fault one upgrade later, so imports must be
covered by the extra's own list. Imports inside `try:` blocks (optional fast paths) are exempt.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# Modules whose distribution name differs and that packages_distributions() may not know
# because the distribution is not installed here (never imported unguarded by shipped code).
_DIST_OF_MODULE = {"yaml": "pyyaml", "zmq": "pyzmq"}


def _req_name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _extra_requirements(extra: str | None) -> set[str]:
    names = {_req_name(r) for r in PYPROJECT["project"]["dependencies"]}
    for req in PYPROJECT["project"]["optional-dependencies"].get(extra, []):
        names.add(_req_name(req))
    return names


def _guarded_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try):
            for child in node.body:
                for sub in ast.walk(child):
                    if hasattr(sub, "lineno"):
                        lines.add(sub.lineno)
    return lines


def _third_party_imports(root: Path) -> dict[str, str]:
    """top-level module -> first file:line that imports it unguarded."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        guarded = _guarded_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            if node.lineno in guarded:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top in sys.stdlib_module_names or top in ("shoal", "__future__"):
                    continue
                found.setdefault(top, f"{path.relative_to(REPO)}:{node.lineno}")
    return found


@pytest.mark.parametrize("extra,root", [("engine", "engine/shoal/engine"),
                                        ("router", "router/shoal/router"),
                                        ("router", "fetch/shoal/fetch"),
                                        ("operator", "operator/shoal/operator"),
                                        (None, "contract/shoal/contract"),
                                        (None, "cli/shoal/cli")])
def test_every_import_is_a_direct_requirement_of_its_extra(extra: str | None, root: str) -> None:
    wanted = _extra_requirements(extra)
    dists = md.packages_distributions()
    missing = []
    for module, where in sorted(_third_party_imports(REPO / root).items()):
        candidates = {d.lower().replace("_", "-") for d in dists.get(module, [])}
        candidates.add(_DIST_OF_MODULE.get(module, module).lower().replace("_", "-"))
        if not candidates & wanted:
            missing.append(f"{module} (imported at {where}; distribution "
                           f"{'/'.join(sorted(candidates))})")
    where = f"[project.optional-dependencies].{extra}" if extra else "[project].dependencies"
    assert not missing, (f"shoal[{extra or ''}] does not list what its code imports; add to "
                         f"{where} in pyproject.toml:\n  "
                         + "\n  ".join(missing))
