"""Which device `--device auto` (shoal serve's default) means: CUDA when torch sees a GPU, else
the CPU, as vLLM picks its platform.

The choice is a pure function of the request and a probe's answer (choose_device), so it is
tested as a table. The probe is torch's own answer, `torch.cuda.is_available()`, asked without
importing torch into the frontend, which never imports it (docs/serving.md): a torch built
without CUDA or ROCm (its `torch/version.py` says so, read as text) cannot see a GPU, which
settles the CPU image at no cost; a GPU build is asked in a short child process (about 2 s,
once, before the engine starts). Torch-free.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

_ASK_TORCH = ("import torch; print(int(torch.cuda.is_available()), torch.cuda.device_count(), "
              "torch.__version__)")


@dataclass(frozen=True)
class CudaProbe:
    """What torch says about CUDA on this machine, and the words for why."""

    available: bool
    detail: str


@dataclass(frozen=True)
class DeviceChoice:
    device: str  # what the engine runs on: "cpu", "cuda", "cuda:N"
    why: str

    @property
    def log_line(self) -> str:
        return f"device: {self.device} ({self.why})"


def choose_device(requested: str, probe: CudaProbe | None) -> DeviceChoice:
    """`auto` -> cuda when the probe saw a GPU, else cpu; any other value is taken as given
    (an explicit cuda on a machine without one fails in the engine, naming it)."""
    if requested != "auto":
        return DeviceChoice(requested, "--device " + requested)
    if probe is None:
        raise ValueError("--device auto needs a probe of torch's CUDA view")
    if probe.available:
        return DeviceChoice("cuda", f"--device auto: {probe.detail}")
    return DeviceChoice("cpu", f"--device auto: {probe.detail}; running on the CPU")


def torch_build() -> dict[str, str | None] | None:
    """`torch/version.py`'s literals (__version__, cuda, hip) without importing torch, or None
    when torch is not installed (or the file has another shape: then ask torch itself)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(spec.submodule_search_locations[0]) / "version.py").read_text())
    except (OSError, SyntaxError):
        return None
    found: dict[str, str | None] = {}
    for node in tree.body:
        target = (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1
                  else node.target if isinstance(node, ast.AnnAssign) else None)
        if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
            found[target.id] = node.value.value
    return found if {"__version__", "cuda"} <= found.keys() else None


def probe_cuda() -> CudaProbe:
    """torch.cuda.is_available(), asked the cheapest exact way (module docstring)."""
    build = torch_build()
    if build is not None and not build.get("cuda") and not build.get("hip"):
        return CudaProbe(False, f"torch {build['__version__']} is built without CUDA")
    try:
        done = subprocess.run([sys.executable, "-c", _ASK_TORCH], capture_output=True,
                              text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return CudaProbe(False, f"asking torch for CUDA failed ({exc})")
    words = done.stdout.split()
    if done.returncode != 0 or len(words) != 3:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return CudaProbe(False, f"asking torch for CUDA failed (exit {done.returncode}: {tail})")
    available, count, version = words[0] == "1", int(words[1]), words[2]
    if available:
        return CudaProbe(True, f"torch {version} sees {count} CUDA device(s)")
    return CudaProbe(False, f"torch {version} sees no CUDA device "
                            "(torch.cuda.is_available() is False)")
