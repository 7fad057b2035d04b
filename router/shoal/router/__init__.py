"""The fleet frontend (`shoal serve --frontend-only`) and the fleet gateway
(`shoal gateway`): OpenAI-aware HTTP routers.

They load no model and speak no ZeroMQ: they forward plain OpenAI HTTP to engine groups (each a
`shoal serve` or `vllm serve` rank 0) listed in the operator's discovery data.

Modules: `discovery` (the file and its watcher), `k8s_discovery` (one ConfigMap through the API),
`picker` (which group gets the next request, cool-downs), `affinity` (prefix-affinity routing),
`metrics` (the routers' own Prometheus series), `errors` (OpenAI error JSON), `proxy` (one
forwarded request, retries, streaming), `health` (probes), `app` (the per-engine FastAPI
surface), `main` (`run_router(args)`, `serve_app`); the gateway's: `fleet` (engines and models),
`fleet_sources` (discovery ConfigMaps through the API, or a directory), `aggregate` (`vllm:*`
summed per model), `gateway` (its app and command line). Everything here is torch-free.
"""
