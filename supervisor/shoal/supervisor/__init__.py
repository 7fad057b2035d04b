"""Shoal's supervisor for stock vLLM engine pods (shoal.contract.supervisor).

It runs as PID 1 of a `runtime: VLLM` engine container, with the vLLM image's own python3 and
the standard library only (it ships as a zipapp, shoal.supervisor.bundle): it runs `vllm serve`
as its child, forwards signals, passes the log through unchanged, reaps orphans, watches every
vLLM process, and writes the termination message naming the process that died first, its signal
or exit code, and vLLM's root cause (docs/vllm-runtime.md, "The supervisor").
"""
