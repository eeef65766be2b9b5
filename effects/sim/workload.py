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
    system      the system prompt its prompt starts with (one of `system_prompts`), or -1
    conv, history  a multi-turn conversation's id and the lengths of its segments so
                far (user turn, reply, user turn, ...): the prompt is the system prompt,
                then every earlier turn and reply of the conversation, then the new turn

Token ids are not stored: `prompt_tokens(spec)` and `reply_tokens(spec, n)` rebuild
them from seeded segments (a segment's ids are its key's SHAKE-128 digest: `_draw`),
so a later turn extends exactly the prompt and the reply of
its earlier turns (what a prefix cache can hit), and requests share system prompts.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from hashlib import shake_128 as _shake

import msgspec
import numpy

__all__ = ["FAULTS", "FAULT_KINDS", "KINDS", "RequestSpec", "WorkloadConfig", "generate",
           "prompt_tokens", "reply_tokens"]

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
    system: int = -1
    system_len: int = 0
    conv: int = -1
    history: tuple[int, ...] = ()


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
    system_prompts: int = 4
    """Distinct system prompts; a request starts with one with `system_fraction`."""
    system_prompt_len: int = 96
    system_fraction: float = 0.6
    conversation_fraction: float = 0.3
    """Requests that continue a multi-turn conversation (its earlier turns and replies
    are their prompt's prefix)."""
    conversations: int = 32
    """Conversations open at once; a new one replaces a full one."""

    def validate(self) -> None:
        """Raise ValueError naming the first bad option and its allowed range."""
        if self.requests < 0:
            raise ValueError(f"--requests must be >= 0, got {self.requests}")
        for name in ("abort_rate", "fault_rate", "disagg_fraction", "prefetch_fraction",
                     "sampling_fraction", "lora_fraction", "system_fraction",
                     "conversation_fraction"):
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
        if self.lora_fraction > 0 and not self.adapters:
            raise ValueError(f"lora_fraction {self.lora_fraction} asks for LoRA requests "
                             "but adapters is empty; name at least one adapter or set "
                             "lora_fraction=0")


_IDS = numpy.array(range(1, 32001), dtype=object)[numpy.arange(1 << 16) % 32000]
"""Token id of each 16-bit draw: the int objects themselves (an object array), so
a draw's `tolist()` shares them instead of making an int per token."""
_take = _IDS.take
_frombuffer = numpy.frombuffer
_U16 = numpy.dtype(numpy.uint16)  # native order (a dtype object: no lookup per call)


def _draw(key: str, n: int) -> list[int]:
    """`n` token ids (1..32000) derived from `key` (the same key always gives the same
    ids), a new list: each id is a native-order 16-bit word of the key's SHAKE-128
    digest, mod 32000, plus 1 (array indexing, not a loop in Python).
    """
    if n == 0:
        return []
    return _take(_frombuffer(_shake(key.encode()).digest(2 * n), _U16)).tolist()


@functools.lru_cache(maxsize=1 << 16)
def _segment(key: str, n: int) -> tuple[int, ...]:
    """`_draw(key, n)`, kept: the segments that recur (system prompts, conversation
    turns and replies). A request's own segments (the rest of its prompt, a reply
    that no later turn repeats) are drawn by `_draw` uncached: tens of thousands of
    them would push out the few hundred that recur, each then drawn again.

    The simulator makes the disaggregated requests' prompts before its run and the
    others' during it: two passes over the conversations, so a segment made in the
    first is read in the second a workload later. 65,536 segments (a conversation
    turn or reply each, ~20 ids, ~400 B with its cache entry: ~26 MB at most) hold
    every one of 100,000 requests' (59,660); 4,096 held a third of 20,000 requests'
    (11,736), and 3,952 of them were drawn twice (10 % of the run's draws)."""
    return tuple(_draw(key, n))


def _build(spec: RequestSpec, seed: int) -> list[int]:
    """The prompt's token ids, a new list (see `prompt_tokens`)."""
    head = f"{seed}/"
    if spec.system < 0 and spec.conv < 0:  # only its own segment (most requests)
        return _draw(head + spec.rid, spec.prompt_len) if spec.prompt_len > 0 else []
    out: list[int] = []
    if spec.system >= 0:
        out += _segment(f"{head}system/{spec.system}", spec.system_len)
    if spec.conv >= 0:
        conv = f"{head}conv/{spec.conv}/"
        for j, n in enumerate(spec.history):
            out += _segment(f"{conv}{j}", n)
    rest = spec.prompt_len - len(out)
    if rest > 0:  # (a conversation's prompt is its system prompt and turns only)
        out += _draw(head + spec.rid, rest)
    elif rest < 0:
        del out[spec.prompt_len:]
    return out


@functools.lru_cache(maxsize=1024)
def _prompt(spec: RequestSpec, seed: int) -> tuple[int, ...]:
    return tuple(_build(spec, seed))


def prompt_tokens(spec: RequestSpec, seed: int = 0) -> list[int]:
    """The prompt's token ids (`spec.prompt_len` of them), a new list; see the module
    docstring. (A sampling request's group asks for them once per member: the recent
    ones of such requests are kept; a request of one sample draws its own once, with
    no copy into the cache and back.)"""
    if spec.n == 1:
        return _build(spec, seed)
    return list(_prompt(spec, seed))


def reply_tokens(spec: RequestSpec, n: int, seed: int = 0) -> list[int]:
    """The first `n` tokens the model replies to `spec` (a conversation's next turn
    has them in its prompt)."""
    if spec.conv >= 0:
        return list(_segment(f"{seed}/conv/{spec.conv}/{len(spec.history)}", n))
    return _draw(f"{seed}/{spec.rid}/reply", n)


def _below(bits: Callable[[int], int], n: int) -> int:
    """A uniform int in [0, n), n > 0, from `bits` (a `random.Random`'s `getrandbits`),
    drawn as `Random.randrange(n)` draws it (`_randbelow_with_getrandbits`: the same
    calls of `getrandbits`, so the same value and the same generator state after).
    `generate` draws its ints with it: `randint(a, b)` is `a + _below(bits, b - a + 1)`
    and `choice(seq)` is `seq[_below(bits, len(seq))]`, without the three Python frames
    and argument checks of each such call (a third of `generate`'s time)."""
    if n <= 0:
        raise ValueError(f"empty range to draw from (0..{n - 1}); check the workload's "
                         "ranges (max_prompt >= min_prompt, max_new_tokens >= 1, adapters)")
    k = n.bit_length()
    r = bits(k)
    while r >= n:
        r = bits(k)
    return r


def _shape(cfg: WorkloadConfig, rng: random.Random, convs: dict[int, list[int]],
           next_conv: list[int], prompt: int, max_new: int,
           ) -> tuple[int, int, tuple[int, ...], int]:
    """(system, conv, history, prompt_len) of the next request, drawn from `rng` (apart
    from the main generator, so the rest of the workload is unchanged).

    Its ints are `_below`'s draws, inline (`generate`'s are). `convs` is in increasing
    id order (ids are new when added, and an update keeps a key's place), so an open
    conversation is picked from the dict's order (no sorted copy)."""
    bits, rand = rng.getrandbits, rng.random
    n_systems = cfg.system_prompts
    system = -1
    if n_systems and rand() < cfg.system_fraction:
        k = n_systems.bit_length()
        system = bits(k)
        while system >= n_systems:
            system = bits(k)
    if rand() >= cfg.conversation_fraction:
        return system, -1, (), max(prompt, (cfg.system_prompt_len if system >= 0 else 0) + 1)
    system = max(system, 0) if n_systems else -1
    base = cfg.system_prompt_len if system >= 0 else 0
    cid = -1
    if convs and rand() < 0.8:
        n = len(convs)
        k = n.bit_length()
        cid = bits(k)
        while cid >= n:
            cid = bits(k)
        cid = list(convs)[cid]
    user = bits(6)  # `8 + _below(bits, 41)`
    while user >= 41:
        user = bits(6)
    user += 8
    if cid >= 0:
        hist = convs[cid]
        total = base + sum(hist) + user
        if total <= cfg.max_prompt:
            convs[cid] = [*hist, user, max_new]
            return system, cid, (*hist, user), total
        del convs[cid]
    cid = next_conv[0]
    next_conv[0] += 1
    if len(convs) >= cfg.conversations:
        del convs[min(convs)]
    convs[cid] = [user, max_new]
    return system, cid, (user,), base + user


def generate(cfg: WorkloadConfig) -> list[RequestSpec]:
    """The workload `cfg` describes; the same config always gives the same list.

    Its ints are `_below`'s draws, made inline (the same `getrandbits` calls: the same
    values and generator state) for the ranges every request draws from, without a
    call per draw (four or five a request); a range that is empty raises `_below`'s
    error before anything is drawn."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    shape_rng = random.Random(f"{cfg.seed}/prefixes")
    convs: dict[int, list[int]] = {}
    next_conv = [0]
    out = []
    # The draws of rng.randint / rng.choice, as `_below` makes them (the same values).
    bits, rand = rng.getrandbits, rng.random
    prompts = cfg.max_prompt - cfg.min_prompt + 1
    adapters, n_adapters = cfg.adapters, len(cfg.adapters)
    max_new_tokens = cfg.max_new_tokens
    if cfg.requests:
        for n in (prompts, max_new_tokens):
            if n <= 0:
                _below(bits, n)  # raises, naming the empty range
    k_prompt, k_new, k_adapter = (prompts.bit_length(), max_new_tokens.bit_length(),
                                  n_adapters.bit_length())
    min_prompt, arrivals_per_step = cfg.min_prompt, cfg.arrivals_per_step
    disagg_fraction, lora_fraction = cfg.disagg_fraction, cfg.lora_fraction
    prefetch_below = disagg_fraction + cfg.prefetch_fraction
    sampling = cfg.n > 1
    n_samples, sampling_fraction = cfg.n, cfg.sampling_fraction
    abort_rate, fault_rate = cfg.abort_rate, cfg.fault_rate
    system_len = cfg.system_prompt_len
    spec = RequestSpec
    for i in range(cfg.requests):
        r = rand()
        kind = ("disagg" if r < disagg_fraction else
                "prefetch" if r < prefetch_below else
                "colocated")
        r = bits(k_prompt)
        while r >= prompts:
            r = bits(k_prompt)
        prompt = min_prompt + r
        lora = None
        if kind != "disagg" and rand() < lora_fraction:
            r = bits(k_adapter)
            while r >= n_adapters:
                r = bits(k_adapter)
            lora = adapters[r]
        n = n_samples if (kind == "colocated" and sampling
                          and rand() < sampling_fraction) else 1
        abort_at = None
        if rand() < abort_rate:
            abort_at = bits(4)
            while abort_at >= 13:
                abort_at = bits(4)
        fault = None
        if rand() < fault_rate:
            faults = FAULTS[kind]
            fault = faults[_below(bits, len(faults))]
            if fault == "unknown_adapter":
                lora = "no-such-lora"
            elif fault == "collective" and abort_at is None:
                abort_at = 2  # the collective that fails is the abort's
        r = bits(k_new)
        while r >= max_new_tokens:
            r = bits(k_new)
        max_new = 1 + r
        system, conv, history, prompt = _shape(cfg, shape_rng, convs, next_conv, prompt,
                                               max_new)
        pages = 0
        if kind == "prefetch":
            pages = bits(4)
            while pages >= 8:
                pages = bits(4)
            pages += 1
        out.append(spec(f"r{i}", kind, i // arrivals_per_step, prompt, max_new, lora, n,
                        abort_at, fault, pages, rand() < 0.5, system,
                        system_len if system >= 0 else 0, conv, history))
    return out
