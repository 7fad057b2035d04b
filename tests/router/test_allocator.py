"""The routers' allocator bounds (allocator.py), observed through glibc's own reports in a
fresh process: the arenas eight allocating threads get, and whether a 200 KB block allocated
after a larger one was freed is its own mapping (glibc's default raises the mmap threshold
there, and the block comes from an arena)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # a fresh child process

ROUTER = Path(__file__).resolve().parents[2] / "router"

PROBE = textwrap.dedent("""
    import ctypes, json, re, sys, tempfile, threading
    sys.path.insert(0, sys.argv[1])
    said = None
    if sys.argv[2] == "bound":
        from shoal.router import allocator
        said = allocator.bound()
    libc = ctypes.CDLL(None)

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    libc.free(libc.malloc(300_000))  # by default this raises the mmap threshold above it
    before = libc.mallinfo2().hblks
    block = libc.malloc(200_000)
    mapped = libc.mallinfo2().hblks - before
    libc.free(block)

    barrier = threading.Barrier(8)
    def work():
        barrier.wait()
        kept = [bytes(1000) * 50 for _ in range(50)]
        barrier.wait()
    threads = [threading.Thread(target=work) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    libc.fopen.restype = ctypes.c_void_p
    path = tempfile.mktemp()
    fp = ctypes.c_void_p(libc.fopen(path.encode(), b"w"))
    libc.malloc_info(0, fp)
    libc.fclose(fp)
    heaps = len(re.findall(r"<heap nr=", open(path).read()))
    print(json.dumps({"said": said, "mapped": mapped, "heaps": heaps}))
""")


def probe(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROUTER), mode], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_the_bounds_hold_in_a_process_where_the_defaults_do_not():
    default, bound = probe("default"), probe("bound")
    assert default["heaps"] > 2 and default["mapped"] == 0, default  # what is being bounded
    assert bound["heaps"] <= 2, bound
    assert bound["mapped"] == 1, bound
    assert bound["said"].startswith("allocator: glibc ") and "2 arenas" in bound["said"]
