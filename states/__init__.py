"""Declared machines of LLM serving (request, sampling group, disaggregated prefill,
chunk, prefetch, LoRA adapter, scheduler sequence) and the workload generator. The
reference serving loop that drives them allocates from `kernels`, so it lives in
`effects.serving`.

This package knows no tensors: it imports only `fsm`. Release plans are named here and
implemented in `effects`.
"""
