"""shoal.fetch: the model fetcher an hf:// engine pod runs first (`shoal fetch`).

It downloads one hub repository's engine files (shoal.contract.model_fetch.ENGINE_FILES) into a
Hugging Face cache with the real `huggingface_hub` client, once for every rank and group that
shares the cache, checks each file's size and hash, prints progress lines the operator reads,
and names its failure in the termination message. Torch-free: it runs from the router image.
"""
