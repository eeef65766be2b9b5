"""Declared machines of LLM serving (request, sampling group, disaggregated prefill,
chunk, prefetch, LoRA adapter) and the reference serving loop that drives them.

This package knows no tensors: it imports only `fsm`. Release plans are named here and
implemented in `effects`.
"""
