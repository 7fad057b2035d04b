"""The process half of the EngineCore pair: core/engine_core.py is the pure half (scheduler, KV
cache, executor; no sockets), this package runs it as the engine process, split by role as
vLLM V1's EngineCoreProc is:

- proc.py: EngineCoreProc, the lifecycle (handshake, build, ready, clean stop, death) and
  `main`; `__main__.py` makes the package the process entry
  (`python -m shoal.engine.core.engine_core_proc SPEC_JSON`, spawned by core_client/spawn.py).
- busy_loop.py: the main thread, the only caller of the EngineCore; never touches a socket.
- io_threads.py: the input (DEALER) and output (PUSH) threads, each the only owner of its socket,
  and the queues they share with the busy loop.
- death.py: a death's report (EngineDead), the termination message, and `death_cause`, the one
  function that decides a death's cause (also for worker ranks and the frontend).

Importing this package is cheap: the modules are imported by name.
"""
