"""Declared machines of LLM serving (request, sampling group, disaggregated prefill,
chunk, prefetch, LoRA adapter, scheduler sequence). The reference serving loop that
drives them, and its workload, live in the simulator (`terminus.effects.sim`).

This package knows no tensors: it imports only `fsm`. Release plans are named here and
implemented in `effects`.
"""
