"""The frontend process's engine side: AsyncLLM and what it owns.

- InputProcessor: the only prompt tokenizer; prompts become EngineCoreRequests (token ids).
- OutputProcessor: per-request state, incremental detokenization, stop strings, collectors.
- AsyncLLM: ties them to an AsyncMPClient and runs the one output-handler task.
- FrontendMetrics: vLLM-named Prometheus metrics fed by the output handler.
"""
