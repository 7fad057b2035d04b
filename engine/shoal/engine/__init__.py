"""Shoal's serving engine.

Importing this package must stay cheap and torch-free: the operator image installs it (for the
wire protocol and the termination-message format) without torch. Heavy modules are imported
where they are used.
"""

from shoal.contract import __version__

# vLLM's top-level names: `from shoal.engine import LLM, SamplingParams` as `from vllm import
# ...`. Resolved on first use (PEP 562), so `import shoal.engine` stays torch-free.
_LAZY = {"LLM": "shoal.engine.llm", "RequestOutput": "shoal.engine.llm",
         "CompletionOutput": "shoal.engine.llm", "SamplingParams": "shoal.engine.sampling_params"}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal.engine' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
