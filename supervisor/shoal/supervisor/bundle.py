"""`python -m shoal.supervisor.bundle OUT.pyz`: the supervisor as one zipapp.

The bundle holds shoal.supervisor and shoal.contract (standard library only) and a root
`__main__.py`, so the vLLM image's bare python3 (3.9 and later) runs it with nothing installed.
`shoal` is a namespace package in the source tree; the zip carries an explicit, empty
`shoal/__init__.py`, because zipimport does not find a namespace package in a zip without
directory entries (measured on 3.11: `No module named 'shoal'`), and this zip has none.
"""

from __future__ import annotations

import os
import sys
import time
import zipfile
from pathlib import Path

import shoal.contract
import shoal.supervisor

MAIN = ("import sys\n"
        "from shoal.supervisor.__main__ import main\n"
        "sys.exit(main())\n")
# Fixed timestamps: the same sources make the same bytes (the image layer is cacheable).
EPOCH = (1980, 1, 1, 0, 0, 0)


def sources() -> list[tuple[str, Path]]:
    """(name in the zip, file) for every .py of the two packages."""
    files = []
    for pkg in (shoal.contract, shoal.supervisor):
        for root in pkg.__path__:
            base = Path(root)
            for path in sorted(base.rglob("*.py")):
                rel = path.relative_to(base.parent.parent).as_posix()
                files.append((rel, path))
    return files


def build(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:  # a zipapp: the shebang line, then the zip
        f.write(b"#!/usr/bin/env python3\n")
        with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, data in [("__main__.py", MAIN), ("shoal/__init__.py", "")]:
                zf.writestr(zipfile.ZipInfo(name, EPOCH), data)
            for name, path in sources():
                zf.writestr(zipfile.ZipInfo(name, EPOCH), path.read_bytes())
    os.chmod(tmp, 0o755)
    os.replace(tmp, out)
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m shoal.supervisor.bundle OUT.pyz", file=sys.stderr)
        return 2
    start = time.monotonic()
    out = build(Path(argv[0]))
    print(f"{out}: {out.stat().st_size} bytes in {time.monotonic() - start:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
