"""The simulator skeleton's fast paths against the general paths they stand beside.

Each fast path must give exactly what the general one gives (the simulator's summaries
are compared byte for byte against earlier runs): a one-sample request's prompt drawn
straight into its list against the cached group path, and the prefetch host cache's
one free per rank against one free per cached prefix, and the end-of-run stream
audits against the per-request loops they replace.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import pytest
import torch

from terminus.effects.sim import workload as wl
from terminus.effects.sim.naive import naive_parts
from terminus.effects.sim.serving import (
    NO_OUTPUT,
    ServingLoop,
    SimConfig,
    SimPrefetch,
    machine_parts,
)
from terminus.effects.sim.workload import WorkloadConfig, generate, prompt_tokens


def test_a_one_sample_prompt_is_the_cached_paths_prompt():
    specs = generate(WorkloadConfig(requests=400, seed=9, n=3))
    shapes = {(s.n > 1, s.system >= 0, s.conv >= 0) for s in specs}
    assert {(False, False, False), (False, True, False), (False, True, True),
            (True, False, False)} <= shapes  # every shape of prompt is exercised
    wl._prompt.cache_clear()
    for spec in specs:
        for seed in (0, 9):
            got = prompt_tokens(spec, seed)
            assert got == list(wl._prompt(spec, seed))  # the general (cached) path
            assert len(got) == spec.prompt_len
            got.append(-1)  # the caller's own list: the next call is unchanged
            assert prompt_tokens(spec, seed) == got[:-1]
    ones = [s for s in specs if s.n == 1]
    wl._prompt.cache_clear()
    for spec in ones:
        prompt_tokens(spec)
    assert wl._prompt.cache_info().currsize == 0  # one-sample prompts are not kept
    group = next(s for s in specs if s.n > 1)
    prompt_tokens(group)
    prompt_tokens(group)
    assert wl._prompt.cache_info().hits == 1  # a group's members share theirs


def test_an_empty_one_sample_prompt_is_empty():
    spec = generate(WorkloadConfig(requests=1, seed=0, system_fraction=0.0,
                                   conversation_fraction=0.0))[0]
    import msgspec

    empty = msgspec.structs.replace(spec, prompt_len=0, n=1)
    assert prompt_tokens(empty) == [] == list(wl._prompt(empty, 0))


def _fill(prefetch: SimPrefetch) -> None:
    """Cache prefixes of different sizes on every rank, interleaved as a run does."""
    for k, n in enumerate((3, 1, 4, 1, 5, 9, 2, 6)):
        for s in prefetch.sites:
            pages = s.host.alloc(n + s.rank)
            assert pages is not None
            prefetch.cache[(s.rank, f"r{k}")] = pages


def test_evicting_the_host_cache_frees_as_one_free_per_prefix_did():
    cfg = SimConfig(ranks=4, tp=2, host_pages=64)
    new, ref = SimPrefetch(cfg), SimPrefetch(cfg)
    _fill(new)
    _fill(ref)
    new.evict()
    for (rank, _), pages in ref.cache.items():  # the per-prefix reference
        ref.sites[rank].host.free(pages)
    ref.cache.clear()
    assert not new.cache
    for a, b in zip(new.sites, ref.sites, strict=True):
        assert a.host.occupied == b.host.occupied == 0
        # The free lists are in the same order: the next pages handed out are the same.
        got, want = a.host.alloc(64), b.host.alloc(64)
        assert got is not None and want is not None and torch.equal(got, want)
        a.host.free(got)
        b.host.free(want)
        a.host.assert_full()
        b.host.assert_full()
    new.evict()  # an empty cache frees nothing
    assert all(s.host.occupied == 0 for s in new.sites)
    assert new.leaks() == {"host_pages": 0, "prefetch_tokens": 0, "ledger_handles": 0}


def _reference_audit(loop: ServingLoop) -> dict[str, Any]:
    """The stream audits as they were written first: every request through
    `_streamed` and `_children`, outcomes counted one by one."""
    streams = loop.stream_counts()
    first = loop.sink.first()
    outcomes: Counter[str] = Counter()
    for spec in loop.workload:
        own = first.get(spec.rid)
        if own is not None:
            outcomes[own.outcome] += 1
        elif any(c in first for c in loop._children(spec)):
            outcomes["fanned_out"] += 1
        else:
            outcomes[NO_OUTPUT] += 1
    return {
        "missing_streams": sum(1 for rid in loop._expected_streams()
                               if not loop._streamed(rid, streams)),
        "duplicate_streams": sum(max(0, c - 1) for c in streams.values()),
        "max_streams": max(streams.values(), default=0),
        "terminal_states": outcomes,
    }


@pytest.mark.parametrize("naive", [False, True], ids=["machines", "naive"])
def test_the_stream_audits_count_as_the_per_request_reference(naive):
    # The naive loop streams some requests twice and some not at all (its seeds'
    # leaks): both counts are exercised, and sampling groups (n=3) fan out.
    workload = generate(WorkloadConfig(requests=300, seed=6, n=3, abort_rate=0.3,
                                       fault_rate=0.2))
    loop = ServingLoop(workload, SimConfig(page_size=16),
                       parts=naive_parts if naive else machine_parts)
    asyncio.run(loop.run())
    ref = _reference_audit(loop)
    leaks = loop.leaks()
    got = {"missing_streams": leaks["missing_streams"],
           "duplicate_streams": leaks["duplicate_streams"],
           "max_streams": loop.max_streams_per_request(),
           "terminal_states": loop.terminal_states()}
    assert got == ref
    assert ref["terminal_states"]["fanned_out"] > 0
    if naive:
        assert ref["missing_streams"] > 0 and ref["duplicate_streams"] > 0
        assert ref["terminal_states"][NO_OUTPUT] > 0
    else:
        assert leaks == dict.fromkeys(leaks, 0)  # the machines: nothing left over


def test_the_disagg_driver_records_injected_faults_and_carries_on():
    # SimDisagg.step catches a driver call's injected fault (a refused KV alloc, a
    # refused cache insert) at the call and records it: the request ends, nothing leaks.
    from terminus.effects.callsites import InjectedFault
    from terminus.effects.output import OutputLog
    from terminus.effects.sim.serving import SimDisagg
    from terminus.fsm import ReleaseFailed

    specs = generate(WorkloadConfig(requests=600, seed=4, fault_rate=0.6,
                                    disagg_fraction=1.0, prefetch_fraction=0.0,
                                    abort_rate=0.0))
    faults = Counter(s.fault for s in specs)
    assert faults["allocator"] and faults["cache_insert"]
    sim = SimDisagg(SimConfig(page_size=16), OutputLog(), specs)
    by_step: dict[int, list[Any]] = {}
    for s in specs:
        by_step.setdefault(s.arrival, []).append(s)
    now = 0
    while now <= max(by_step) or not sim.idle:
        for s in by_step.get(now, ()):
            sim.add(s)
        sim.step()
        now += 1
        assert now < 10_000, sim.stuck()
    injected = [e for e in sim.errors if isinstance(e, InjectedFault)]
    refused = [e for e in sim.errors if isinstance(e, ReleaseFailed)]
    assert len(injected) == len(sim.faults.fired) > 0  # each refused alloc, once
    assert len(refused) == sim.cache.refused > 0  # each refused cache insert, once
    assert len(sim.errors) == len(injected) + len(refused)
    assert sim.leaks() == dict.fromkeys(sim.leaks(), 0)


class _DoneCallbackLoop(ServingLoop):
    """Also keeps the requests' tasks as the loop did before: a set each task's done
    callback drops it from. At each end-of-run check the loop reads whether a task is
    still running as it yields (`_prune_tasks`); the set, read after the yield, is
    what the old check read."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ref: set[Any] = set()
        self.read: bool | None = None
        self.checks: list[tuple[bool, bool]] = []  # (tasks running: new, old)

    def _submit(self, spec: Any, now: int) -> None:
        super()._submit(spec, now)
        if spec.kind != "disagg":
            task = self._tasks[-1]
            self.ref.add(task)
            task.add_done_callback(self.ref.discard)

    def _prune_tasks(self) -> bool:
        self.read = super()._prune_tasks()
        return self.read

    def _shed_errors(self, lists: Any) -> None:  # right after the yield: the check next
        if self.read is not None:
            self.checks.append((self.read, bool(self.ref)))
            self.read = None
        super()._shed_errors(lists)


@pytest.mark.parametrize("naive", [False, True], ids=["machines", "naive"])
@pytest.mark.parametrize(("seed", "abort_rate"), [(1, 0.0), (2, 0.0), (3, 0.2)])
def test_the_end_of_run_check_reads_the_tasks_as_the_done_callbacks_left_them(
        naive, seed, abort_rate):
    # Requests still in their LoRA acquire at the last arrival's check (no abort to
    # come: the check reads the tasks there), and rejected prompts that end their
    # tasks with nothing sent to the scheduler: the run must end at the same step.
    # (No prefetch without aborts: a collective fault is an abort's.)
    workload = generate(WorkloadConfig(requests=200, seed=seed, n=3, fault_rate=0.5,
                                       abort_rate=abort_rate, arrivals_per_step=3,
                                       prefetch_fraction=0.15 if abort_rate else 0.0))
    loop = _DoneCallbackLoop(workload, SimConfig(page_size=16),
                             parts=naive_parts if naive else machine_parts)
    asyncio.run(loop.run())
    assert loop.checks and all(new == old for new, old in loop.checks), loop.checks
    if not abort_rate:
        assert any(new for new, _ in loop.checks)  # a task ran at the last arrival's
    assert not loop.ref and not any(not t.done() for t in loop._tasks)
    leaks = loop.leaks()
    if not naive:
        assert leaks == dict.fromkeys(leaks, 0)


def _reference_shape(cfg: WorkloadConfig, rng: Any, convs: dict[int, list[int]],
           next_conv: list[int], prompt: int, max_new: int,
           ) -> tuple[int, int, tuple[int, ...], int]:
    """`workload._shape` as it was: its draws by `_below`, a sorted copy of the ids."""
    bits = rng.getrandbits
    system = wl._below(bits, cfg.system_prompts) if (
        cfg.system_prompts and rng.random() < cfg.system_fraction) else -1
    base = cfg.system_prompt_len if system >= 0 else 0
    if rng.random() < cfg.conversation_fraction:
        system = max(system, 0) if cfg.system_prompts else -1
        base = cfg.system_prompt_len if system >= 0 else 0
        if convs and rng.random() < 0.8:
            ids = sorted(convs)
            cid = ids[wl._below(bits, len(ids))]
        else:
            cid = -1
        user = 8 + wl._below(bits, 41)
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
    return system, -1, (), max(prompt, base + 1)


def _reference_generate(cfg: WorkloadConfig) -> list[Any]:
    """`workload.generate` as it was: a `_below` call per draw, keyword arguments."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    shape_rng = random.Random(f"{cfg.seed}/prefixes")
    convs: dict[int, list[int]] = {}
    next_conv = [0]
    out = []
    # The draws of rng.randint / rng.choice, made by `_below` (the same values).
    bits, rand = rng.getrandbits, rng.random
    prompts = cfg.max_prompt - cfg.min_prompt + 1
    adapters, n_adapters = cfg.adapters, len(cfg.adapters)
    for i in range(cfg.requests):
        r = rand()
        kind = ("disagg" if r < cfg.disagg_fraction else
                "prefetch" if r < cfg.disagg_fraction + cfg.prefetch_fraction else
                "colocated")
        prompt = cfg.min_prompt + wl._below(bits, prompts)
        lora = (adapters[wl._below(bits, n_adapters)]
                if kind != "disagg" and rand() < cfg.lora_fraction else None)
        n = 1
        if kind == "colocated" and cfg.n > 1 and rand() < cfg.sampling_fraction:
            n = cfg.n
        abort_at = wl._below(bits, 13) if rand() < cfg.abort_rate else None
        fault = None
        if rand() < cfg.fault_rate:
            faults = wl.FAULTS[kind]
            fault = faults[wl._below(bits, len(faults))]
        if fault == "unknown_adapter":
            lora = "no-such-lora"
        if fault == "collective" and abort_at is None:
            abort_at = 2  # the collective that fails is the abort's
        max_new = 1 + wl._below(bits, cfg.max_new_tokens)
        system, conv, history, prompt = _reference_shape(cfg, shape_rng, convs, next_conv, prompt,
                                               max_new)
        out.append(wl.RequestSpec(
            rid=f"r{i}",
            kind=kind,
            arrival=i // cfg.arrivals_per_step,
            prompt_len=prompt,
            max_new_tokens=max_new,
            lora=lora,
            n=n,
            abort_at=abort_at,
            fault=fault,
            prefetch_pages=1 + wl._below(bits, 8) if kind == "prefetch" else 0,
            mamba=rand() < 0.5,
            system=system,
            system_len=cfg.system_prompt_len if system >= 0 else 0,
            conv=conv,
            history=history,
        ))
    return out


@pytest.mark.parametrize("cfg", [
    WorkloadConfig(requests=4000, n=3),
    WorkloadConfig(requests=2000, seed=5, n=2, fault_rate=0.5, abort_rate=0.5,
                   lora_fraction=0.9, prefetch_fraction=0.5, disagg_fraction=0.3,
                   max_new_tokens=1, min_prompt=5, max_prompt=5, conversations=3),
    WorkloadConfig(requests=2000, seed=9, system_prompts=0, conversation_fraction=0.9,
                   max_prompt=2000, lora_fraction=0.0, adapters=()),
], ids=["defaults", "faults-and-tiny-ranges", "long-conversations"])
def test_generate_draws_inline_what_the_below_calls_drew(cfg):
    assert generate(cfg) == _reference_generate(cfg)
