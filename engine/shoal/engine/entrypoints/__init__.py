"""Process entry points: `shoal serve` (serve.py) and its HTTP app (api_server.py)."""
