"""The simulator's workload: what arrives when, and what goes wrong, as plain data.

A workload is a list of `RequestSpec`s drawn from a seeded generator, so the same
options always give the same requests (and the naive baseline and the machines see the
same ones). It knows no pools and no tensors: `terminus.effects.sim.serving` executes it.

    kind        "colocated" (tokenizer -> scheduler -> decode batch),
                "disagg"    (disaggregated prefill over a transport),
                "prefetch"  (a colocated request whose prefix is first prefetched from
                             storage into host pages across the attention ranks)
    abort_at    step offset (after arrival) at which the client aborts, or None
    fault       what fails for this request, or None (see FAULTS)
"""

from __future__ import annotations

import random

import msgspec

__all__ = ["FAULTS", "FAULT_KINDS", "KINDS", "RequestSpec", "WorkloadConfig", "generate"]

KINDS = ("colocated", "disagg", "prefetch")

FAULTS = {
    "colocated": ("scheduler_400", "scheduler_500", "scheduler_503", "dispatch",
                  "invalid_prompt", "unknown_adapter", "stream"),
    "disagg": ("bootstrap", "transport", "sender_abort", "cache_insert", "allocator",
               "stream"),
    "prefetch": ("scheduler_500", "collective"),
}
"""Faults a request of each kind can suffer (chosen uniformly when one is drawn)."""

FAULT_KINDS = {
    "scheduler_400": "scheduler", "scheduler_500": "scheduler",
    "scheduler_503": "scheduler", "dispatch": "transport", "invalid_prompt": "tokenizer",
    "unknown_adapter": "registry", "stream": "stream", "bootstrap": "transport",
    "transport": "transport", "sender_abort": "transport", "cache_insert": "cache_insert",
    "allocator": "allocator", "collective": "collective",
}
"""The call-site kind (`terminus.effects.callsites.KINDS`) each fault hits; "scheduler"
is the scheduler failing a request it runs (not a call that leaves the engine)."""


class RequestSpec(msgspec.Struct, frozen=True, gc=False):
    """One request of the workload."""

    rid: str
    kind: str
    arrival: int
    prompt_len: int
    max_new_tokens: int
    lora: str | None
    n: int
    abort_at: int | None
    fault: str | None
    prefetch_pages: int = 0
    mamba: bool = True


class WorkloadConfig(msgspec.Struct, frozen=True):
    """Options of `generate` (the simulator's command-line options map onto these)."""

    requests: int = 2000
    seed: int = 0
    abort_rate: float = 0.15
    fault_rate: float = 0.05
    n: int = 1
    disagg_fraction: float = 0.2
    prefetch_fraction: float = 0.15
    sampling_fraction: float = 0.1
    lora_fraction: float = 0.5
    adapters: tuple[str, ...] = ("sql-lora", "chat-lora", "code-lora")
    arrivals_per_step: int = 16
    chunk_size: int = 64
    min_prompt: int = 16
    max_prompt: int = 320
    max_new_tokens: int = 24

    def validate(self) -> None:
        """Raise ValueError naming the first bad option and its allowed range."""
        if self.requests < 0:
            raise ValueError(f"--requests must be >= 0, got {self.requests}")
        for name in ("abort_rate", "fault_rate", "disagg_fraction", "prefetch_fraction",
                     "sampling_fraction", "lora_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be between 0 and 1, got {v}")
        if self.disagg_fraction + self.prefetch_fraction > 1.0:
            raise ValueError("--disagg-fraction plus --prefetch-fraction must not exceed 1")
        if self.n < 1:
            raise ValueError(f"--n (parallel samples) must be >= 1, got {self.n}")
        if self.arrivals_per_step < 1:
            raise ValueError(f"arrivals_per_step must be >= 1, got {self.arrivals_per_step}")


def generate(cfg: WorkloadConfig) -> list[RequestSpec]:
    """The workload `cfg` describes; the same config always gives the same list."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    out = []
    for i in range(cfg.requests):
        r = rng.random()
        kind = ("disagg" if r < cfg.disagg_fraction else
                "prefetch" if r < cfg.disagg_fraction + cfg.prefetch_fraction else
                "colocated")
        prompt = rng.randint(cfg.min_prompt, cfg.max_prompt)
        lora = (rng.choice(cfg.adapters)
                if kind != "disagg" and rng.random() < cfg.lora_fraction else None)
        n = 1
        if kind == "colocated" and cfg.n > 1 and rng.random() < cfg.sampling_fraction:
            n = cfg.n
        abort_at = rng.randint(0, 12) if rng.random() < cfg.abort_rate else None
        fault = rng.choice(FAULTS[kind]) if rng.random() < cfg.fault_rate else None
        if fault == "unknown_adapter":
            lora = "no-such-lora"
        if fault == "collective" and abort_at is None:
            abort_at = 2  # the collective that fails is the abort's

        out.append(RequestSpec(
            rid=f"r{i}",
            kind=kind,
            arrival=i // cfg.arrivals_per_step,
            prompt_len=prompt,
            max_new_tokens=rng.randint(1, cfg.max_new_tokens),
            lora=lora,
            n=n,
            abort_at=abort_at,
            fault=fault,
            prefetch_pages=rng.randint(1, 8) if kind == "prefetch" else 0,
            mamba=rng.random() < 0.5,
        ))
    return out
