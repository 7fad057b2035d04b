"""The fleet frontend (`shoal serve --frontend-only`): an OpenAI-aware HTTP router.

It loads no model and speaks no ZeroMQ: it forwards plain OpenAI HTTP to engine groups (each a
`shoal serve` or `vllm serve` rank 0) listed in the operator's discovery file.

Modules: `discovery` (the file and its watcher), `picker` (which group gets the next request,
cool-downs), `metrics` (the router's own Prometheus series), `errors` (OpenAI error JSON),
`proxy` (one forwarded request, retries, streaming), `app` (the FastAPI surface), `main`
(`run_router(args)`: uvicorn and the background tasks). Everything here is torch-free.
"""
