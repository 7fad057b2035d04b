"""The router's tokenizer keeps a bounded word cache (kv_score.bound_word_cache), observed
through glibc's count of bytes in use in a fresh process while unique words go through it:
`tokenizers`' default cache keeps growing for 10,000 new words, the capped one stops at
WORD_CACHE."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROUTER = Path(__file__).resolve().parents[2] / "router"

PROBE = textwrap.dedent("""
    import ctypes, json, sys
    sys.path.insert(0, sys.argv[1])
    from shoal.router.kv_score import PromptTokenizer
    from tokenizers import Tokenizer

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                    "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[3] == "router":
        encode = PromptTokenizer(sys.argv[2]).encode
    else:
        tok = Tokenizer.from_file(sys.argv[2] + "/tokenizer.json")
        encode = lambda text: tok.encode(text).ids
    used = []
    for i in range(4000):  # three new words each: 12,000 in all
        encode(f"Request {i} serial{i}x user{i * 7919}y: the same words after them each time")
        if i in (1500, 3999):
            used.append(libc.mallinfo2().uordblks)
    print(json.dumps({"grew": used[1] - used[0]}))
""")


def grew(model: Path, which: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROUTER), str(model), which],
                         check=True, capture_output=True, text=True, timeout=120).stdout
    return json.loads(out)["grew"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallinfo2")
def test_unique_words_do_not_grow_the_routers_tokenizer(tiny_model):
    default, router = grew(tiny_model, "default"), grew(tiny_model, "router")
    assert default > 512 << 10, default  # what is being bounded: the default keeps filling
    assert router < 64 << 10, router
