"""Structured output: grammars (llguidance) that constrain what a request may generate.

spec.py turns a request's StructuredOutputs into a llguidance grammar and checks it without a
tokenizer (torch-free: the frontend uses it to answer a 400 before the engine sees the request);
manager.py lives in the EngineCore next to the scheduler: it compiles grammars off the busy loop,
fills the per-step token bitmask and advances each matcher with the accepted tokens;
bitmask.py applies that bitmask to the logits in the worker.
"""
