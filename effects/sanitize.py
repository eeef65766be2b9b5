"""The leak sanitizer: pools and ledger agree after every driver call (I9).

Off by default. On (``TERMINUS_SANITIZE=1`` in the environment, ``pytest
--terminus-sanitize``, the ini option ``terminus_sanitize = true``, or ``with
sanitizing():``), every public method of a driver (`TokenizerSide`, `DisaggPrefill`,
`PrefetchSite`, `RunningBatch`, `AdapterManager`) ends by auditing that driver:

    for each handle kind:  units the pool has handed out  ==  units the ledger says
                           (minus what a documented       its owners hold
                           holder outside keeps: the      (`units(kind, handle.value)`)
                           prefix cache)

and every unit a handle owns is still allocated in its pool (and owned by one handle
only), and the pool's own checks (double free, foreign index) pass. A mismatch raises
`LeakSanitizerError` naming the driver, the call, its caller's file and line, the kind,
the two counts and the units that differ. So a resource taken outside the ledger, or a
unit freed that no handle owns, fails at the call that did it, not at the end of a test.

Drivers opt in with the `sanitized` decorator on their public methods, and an audit
function registered for their class (`register_audit`); a handle kind's unit count comes
from `register_units`. The check is a few tensor reductions per call, so it is for test
suites, not production.

The switch costs nothing while it is off: ``ENV`` is read once per process (at the first
call of a sanitized method, or by `refresh()`), and a decorated method is the plain
function on its class while the sanitizer is off, the auditing wrapper only while it is
on (`sanitizing()` and `refresh()` swap them). A process that changes ``ENV`` after its
first driver call calls `refresh()` to have it read again (the pytest plugin does, for
``--terminus-sanitize``, the ini option and each ``terminus_no_sanitize`` test).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

__all__ = [
    "ENV",
    "Finding",
    "LeakSanitizerError",
    "audit",
    "enabled",
    "refresh",
    "register_audit",
    "register_units",
    "sanitized",
    "sanitizing",
    "units",
]

ENV = "TERMINUS_SANITIZE"
"""The environment variable that turns the sanitizer on (``1``, ``true``, ``yes``).
Read once per process; `refresh()` reads it again."""

_forced: list[bool] = []
_env: list[bool] = []  # ENV as last read: empty until the first read
_installed: list[bool | None] = [None]  # what the decorated classes carry now


def _read_env() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def enabled() -> bool:
    """Whether driver calls are audited now."""
    if _forced:
        return _forced[-1]
    if not _env:
        _env.append(_read_env())
        _install()
    return _env[0]


def refresh() -> bool:
    """Read `ENV` again (after the process changed it); returns whether driver calls are
    audited now. The variable is otherwise read once per process, at the first call of a
    sanitized method."""
    _env[:] = [_read_env()]
    _install()
    return enabled()


@contextmanager
def sanitizing(on: bool = True) -> Iterator[None]:
    """Turn the sanitizer on (or off, ``on=False``) inside the block, whatever `ENV` says."""
    _forced.append(on)
    _install()
    try:
        yield
    finally:
        _forced.pop()
        _install()


class _Switch:
    """A sanitized method while its class is being made: once the class exists it puts
    the plain function or the auditing wrapper on it (`_install` swaps them). Used
    outside a class body it stays, and always calls the wrapper."""

    __slots__ = ("name", "owner", "plain", "wrapper")

    def __init__(self, plain: Callable[..., Any], wrapper: Callable[..., Any]) -> None:
        self.plain = plain
        self.wrapper = wrapper
        self.owner: type | None = None
        self.name = plain.__name__

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner, self.name = owner, name
        _SWITCHES.append(self)
        on = _installed[0]
        setattr(owner, name, self.plain if on is False else self.wrapper)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self.wrapper.__get__(obj, objtype)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapper(*args, **kwargs)


_SWITCHES: list[_Switch] = []


def _install() -> None:
    """Put the wrapper (sanitizer on, or ENV not read yet) or the plain function (off)
    on every class with a sanitized method, when that changed."""
    on: bool | None = _forced[-1] if _forced else (_env[0] if _env else None)
    if on is _installed[0]:
        return
    _installed[0] = on
    for sw in _SWITCHES:
        if sw.owner is not None:
            setattr(sw.owner, sw.name, sw.plain if on is False else sw.wrapper)


@dataclass
class Finding:
    """One disagreement: ``kind``, units ``owned`` by handles, units ``in_use`` in the
    pool, and ``detail`` (the units that differ, or what a pool's own check raised)."""

    kind: str
    owned: int
    in_use: int
    detail: str = ""

    def __str__(self) -> str:
        s = f"{self.kind}: the ledger's owners hold {self.owned}, the pool has {self.in_use} in use"
        return s + (f"; {self.detail}" if self.detail else "")


class LeakSanitizerError(AssertionError):
    """Pools and ledger disagree after a driver call; the message names the call site."""

    def __init__(self, driver: str, call: str, site: str, findings: list[Finding]) -> None:
        self.driver = driver
        self.call = call
        self.site = site
        self.findings = findings
        lines = "\n  ".join(str(f) for f in findings)
        super().__init__(
            f"leak sanitizer: after {driver}.{call} (called from {site}) pools and ledger "
            f"disagree:\n  {lines}\nA unit was taken outside the ledger, or freed while a "
            "handle still owns it; every acquire must be recorded in the same step.")


# -- units of a handle, by kind ----------------------------------------------------------

_UNITS: dict[str, Callable[[Any], int]] = {}


def register_units(kind: str, fn: Callable[[Any], int]) -> None:
    """How many pool units a handle of `kind` with value `v` holds: ``fn(v)``."""
    _UNITS[kind] = fn


def units(kind: str, value: Any) -> int:
    """Units a handle of `kind` holds (a tensor's size, else 1, unless registered)."""
    fn = _UNITS.get(kind)
    if fn is not None:
        return int(fn(value))
    if isinstance(value, torch.Tensor):
        return int(value.numel())
    return 1


def _prefetch_pages(p: Any) -> int:
    # A retired prefetch holds nothing; a terminated one holds its completed prefix (the
    # tail went back at terminate); a live one its whole reservation.
    if getattr(p, "retired", False):
        return 0
    if getattr(p, "terminated", False):
        return int(p.completed)
    return int(p.pages.numel())


for _k in ("kv", "mamba", "req_slot"):
    register_units(_k, lambda v: int(v.numel()))
register_units("metadata", lambda v: 1 if v.index >= 0 else 0)
register_units("hicache", _prefetch_pages)
register_units("host_pages", _prefetch_pages)
register_units("lora", lambda v: 1)


# -- audits, by driver class -----------------------------------------------------------------

Audit = Callable[[Any], list[Finding]]
_AUDITS: dict[type, Audit] = {}


def register_audit(cls: type, fn: Audit) -> None:
    """Audit `cls`'s instances with ``fn(driver) -> [Finding]`` (empty when they agree)."""
    _AUDITS[cls] = fn


def audit(driver: Any) -> list[Finding]:
    """What `driver`'s pools and ledger disagree on now (its class's registered audit)."""
    for cls in type(driver).__mro__:
        fn = _AUDITS.get(cls) or _BUILTIN.get((cls.__module__, cls.__qualname__))
        if fn is not None:
            return fn(driver)
    raise TypeError(f"no sanitizer audit is registered for {type(driver).__name__}; "
                    "call terminus.effects.sanitize.register_audit(cls, fn)")


def _caller(depth: int) -> str:
    f: Any = sys._getframe(depth)
    here = os.path.dirname(__file__)
    while f is not None and os.path.dirname(f.f_code.co_filename) == here:
        f = f.f_back
    if f is None:
        return "<unknown>"
    return f"{f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})"


def _check(driver: Any, name: str, site: str, error: BaseException | None) -> None:
    findings = audit(driver)
    if findings:
        raise LeakSanitizerError(type(driver).__name__, name, site, findings) from error


F = TypeVar("F", bound=Callable[..., Any])


def sanitized(method: F) -> F:
    """Audit the driver after each call of `method` when the sanitizer is on.

    On a method in a class body, the class carries the plain method while the
    sanitizer is off (no cost per call) and the auditing wrapper while it is on.

    Nested calls of one driver's sanitized methods are audited once, at the outermost
    (a driver may be mid-way between two of its own steps inside). A coroutine method
    is audited when it returns (every await point of a driver keeps pools and ledger
    in agreement, so the interleaved calls of other tasks audit cleanly too). A call
    that raises is audited too (a refused call changes nothing): its error is the
    sanitizer error's cause.
    """
    name = method.__name__
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def gwrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not enabled():
                return (yield from method(self, *args, **kwargs))
            site = _caller(2)
            try:
                out = yield from method(self, *args, **kwargs)
            except GeneratorExit:
                raise
            except BaseException as e:
                _check(self, name, site, e)
                raise
            _check(self, name, site, None)
            return out

        return _Switch(method, gwrapper)  # type: ignore[return-value]
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def awrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not enabled():
                return await method(self, *args, **kwargs)
            site = _caller(2)
            try:
                out = await method(self, *args, **kwargs)
            except BaseException as e:
                _check(self, name, site, e)
                raise
            _check(self, name, site, None)
            return out

        return _Switch(method, awrapper)  # type: ignore[return-value]

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not enabled():
            return method(self, *args, **kwargs)
        depth = _depth.get(id(self), 0)
        _depth[id(self)] = depth + 1
        site = _caller(2) if depth == 0 else ""
        try:
            out = method(self, *args, **kwargs)
        except BaseException as e:
            _depth[id(self)] = depth
            if depth == 0:
                del _depth[id(self)]
                _check(self, name, site, e)
            raise
        _depth[id(self)] = depth
        if depth == 0:
            del _depth[id(self)]
            _check(self, name, site, None)
        return out

    return _Switch(method, wrapper)  # type: ignore[return-value]


_depth: dict[int, int] = {}


# -- helpers the audits share ----------------------------------------------------------------


def _real(obj: Any) -> Any:
    """The resource behind a recording proxy (`effects.callsites.proxy`), or `obj`."""
    return getattr(obj, "__wrapped__", obj)


def _pool_check(name: str, pool: Any) -> list[Finding]:
    pool = _real(pool)
    check = getattr(pool, "check", None)
    if check is None:
        return []
    try:
        check()
    except Exception as e:  # DoubleFree / ForeignIndex recorded by a non-strict pool
        return [Finding(name, -1, -1, f"the pool's own check raised {e!r}")]
    return []


def _held_ids(pool: Any) -> torch.Tensor | None:
    pool = _real(pool)
    held = getattr(pool, "held", None)
    cap = getattr(pool, "capacity", None)
    if held is None or cap is None:
        return None
    ids = torch.tensor(held(int(cap)), dtype=torch.int64)  # pages, for a paged pool
    if ids.numel() * int(getattr(pool, "page_size", 1) or 1) != _in_use(pool):
        return None  # the pool does not track which (detection off)
    return ids


def _owned_free(kind: str, pool: Any, owned: list[torch.Tensor]) -> list[Finding]:
    """Units a handle owns that the pool has free (or that two handles own)."""
    if not owned:
        return []
    ids = torch.cat([t.reshape(-1).to("cpu", torch.int64) for t in owned])
    if not ids.numel():
        return []
    out = []
    uniq, counts = torch.unique(ids, return_counts=True)
    if bool((counts > 1).any()):
        out.append(Finding(kind, int(ids.numel()), int(uniq.numel()),
                           f"units owned by two handles: {uniq[counts > 1][:16].tolist()}"))
    held = _held_ids(pool)
    if held is not None:
        free = uniq[~torch.isin(uniq, held)]
        if free.numel():
            out.append(Finding(kind, int(uniq.numel()), int(held.numel()),
                               f"units a handle owns but the pool has free (freed while "
                               f"owned): {free[:16].tolist()}"))
    return out


def _pages(ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """The KV pages (the pool's units of identity) that token indices `ids` lie on."""
    ids = ids.reshape(-1).to("cpu", torch.int64)
    return ids if page_size == 1 else torch.unique(torch.div(ids, page_size,
                                                             rounding_mode="floor"))


def _in_use(pool: Any) -> int:
    pool = _real(pool)
    return int(pool.capacity) - int(pool.available)


def _compare(kind: str, owned: int, in_use: int, pool: Any,
             ids: list[torch.Tensor] | None = None, outside: int = 0) -> list[Finding]:
    out = []
    if owned != in_use - outside:
        extra = (f" (of which {outside} held outside the ledger: the prefix cache, or "
                 "pages a reader still locks)") if outside else ""
        held = _held_ids(pool) if ids is not None else None
        detail = ""
        if held is not None and ids is not None and owned < in_use - outside:
            mine = (torch.cat([t.reshape(-1).to("cpu", torch.int64) for t in ids])
                    if ids else torch.empty(0, dtype=torch.int64))
            stray = held[~torch.isin(held, mine)][:16].tolist()
            detail = f"units in use that no handle owns include {stray}"
        out.append(Finding(kind, owned, in_use, (detail + extra).strip()))
    if ids is not None:
        out.extend(_owned_free(kind, pool, ids))
    return out


# -- the drivers' audits ----------------------------------------------------------------


def _audit_disagg(d: Any) -> list[Finding]:
    by_kind: dict[str, list[torch.Tensor]] = {"kv": [], "mamba": [], "req_slot": []}
    owned: Counter[str] = Counter()
    p = d.pools
    ps = int(getattr(p, "page_size", 1) or 1)
    kv_units = getattr(p, "kv_units", None)
    for hs in d.ledger.outstanding().values():
        for h in hs:
            if h.kind == "kv" and kv_units is not None:
                owned["kv"] += kv_units(h.value)  # token slots of whole pages
                by_kind["kv"].append(_pages(h.value, ps))
                continue
            owned[h.kind] += units(h.kind, h.value)
            if h.kind in by_kind:
                by_kind[h.kind].append(h.value)
    cached = int(getattr(d.cache, "held_tokens", 0))
    out: list[Finding] = []
    for name in ("kv", "mamba", "table", "metadata", "host"):
        out += _pool_check(name, getattr(p, name))
    if hasattr(_real(p.kv), "capacity"):
        out += _compare("kv", owned["kv"], _in_use(p.kv), p.kv, by_kind["kv"], cached)
    if hasattr(_real(p.mamba), "capacity"):
        out += _compare("mamba", owned["mamba"], _in_use(p.mamba), p.mamba,
                        by_kind["mamba"])
    out += _compare("req_slot", owned["req_slot"], _in_use(p.table), p.table,
                    by_kind["req_slot"])
    if hasattr(_real(p.metadata), "capacity"):  # an engine's own may not say
        out += _compare("metadata", owned["metadata"], _in_use(p.metadata), p.metadata)
    host = _real(p.host)
    out += _compare("hicache", owned["hicache"], host.occupied, host,
                    outside=int(getattr(host, "deferred", 0)))
    return out


def _audit_running(rb: Any) -> list[Finding]:
    pools = rb.pools
    m = rb.batch.machine
    st = rb.batch.states
    owning = torch.ones(len(m.states), dtype=torch.bool, device=st.device)
    for i, term in enumerate(m.terminal):
        if term:
            owning[i] = False
    owning[m.state_id("vacant")] = False
    live = owning.index_select(0, st).index_fill_(0, rb.admitting, True).nonzero().squeeze(1)
    table = pools.table
    ps = int(getattr(pools, "page_size", 1) or 1)
    lengths = table.lengths.index_select(0, live).to(torch.int64)
    mslots = table.mamba_slots.index_select(0, live)
    # A row owns whole pages of its own past the prefix it matched in the prefix cache
    # (whole pages too): ceil((length - matched) / page_size) of them. The cache holds
    # the rest, outside the ledger.
    cache = getattr(rb, "cache", None)
    starts = [rb.matched(int(r)) if cache is not None else 0 for r in live.tolist()]
    kv_ids = [_pages(table.req_to_token[int(r), m:int(n)], ps) for r, n, m in
              zip(live.tolist(), lengths.tolist(), starts, strict=True) if n > m]
    own = lengths - torch.tensor(starts, dtype=torch.int64)
    owned_kv = int((-(-own.clamp(min=0) // ps)).sum()) * ps
    cached = int(cache.held_tokens) if cache is not None else 0
    out: list[Finding] = []
    for name in ("kv", "mamba", "table"):
        out += _pool_check(name, getattr(pools, name))
    if hasattr(_real(pools.kv), "capacity"):
        out += _compare("kv", owned_kv, _in_use(pools.kv), pools.kv, kv_ids, cached)
    if cache is not None:
        try:
            rb.audit()  # every page: one holder (pool, cache, or a live row)
        except AssertionError as e:
            out.append(Finding("kv", owned_kv, _in_use(pools.kv), f"page audit: {e}"))
    if hasattr(_real(pools.mamba), "capacity"):
        out += _compare("mamba", int((mslots != 0).sum()), _in_use(pools.mamba),
                        pools.mamba, [mslots[mslots != 0]])
    out += _compare("req_slot", int(live.numel()), _in_use(table), table, [live])
    return out


_LORA_SIDES: dict[int, weakref.WeakSet[Any]] = {}


def track_lora_side(side: Any) -> None:
    """Record a tokenizer side: sides over one registry are audited together.

    A registry whose sides are all gone is forgotten here (its entry is keyed by id,
    which a later registry may reuse): a process that makes a side per run, as the
    benchmarks do, keeps one entry per live registry, not one per registry it made."""
    for key in [k for k, sides in _LORA_SIDES.items() if not sides]:
        del _LORA_SIDES[key]
    _LORA_SIDES.setdefault(id(_real(side.registry)), weakref.WeakSet()).add(side)


def _audit_tokenizer(side: Any) -> list[Finding]:
    reg = _real(side.registry)
    counts = getattr(reg, "counts", None)
    if counts is None:
        return []
    ledgers = {id(s.ledger): s.ledger for s in _LORA_SIDES.get(id(reg), ()) if
               _real(s.registry) is reg}
    ledgers[id(side.ledger)] = side.ledger
    owned: Counter[Any] = Counter()
    pending = 0
    for led in ledgers.values():
        pending += led.pending
        for hs in led.outstanding().values():
            for h in hs:
                if h.kind == "lora":
                    owned[h.value] += 1
    have = counts()
    out = []
    spare = pending  # references whose release task is still running
    for i in sorted(set(have) | set(owned)):
        c, o = int(have.get(i, 0)), owned[i]
        if c == o:
            continue
        if c > o and c - o <= spare:
            spare -= c - o
            continue
        out.append(Finding("lora", o, c, f"adapter id {i}: the registry counts {c} "
                                         f"references, the ledger's handles hold {o}"))
    return out


def _audit_prefetch(site: Any) -> list[Finding]:
    host = _real(site.host)
    reserved = 0
    pages: list[torch.Tensor] = []
    locks: list[torch.Tensor] = []
    for hs in site.ledger.outstanding().values():
        for h in hs:
            if h.kind == "host_pages" and not h.value.retired:
                reserved += int(h.value.pages.numel())
                keep = (h.value.pages[: h.value.completed] if h.value.terminated
                        else h.value.pages)
                pages.append(keep)
            elif h.kind == "host_lock":
                locks.append(h.value)
    out = _pool_check("host", host)
    if reserved != host.prefetch_occupied:
        out.append(Finding("host_pages", reserved, host.prefetch_occupied,
                           "pages reserved by prefetches the ledger does not own"))
    out += _owned_free("host_pages", host, pages)
    if locks:
        ids = torch.cat([t.reshape(-1).to(host.lock_refs.device, torch.int64) for t in locks])
        need = torch.zeros_like(host.lock_refs)
        need.index_add_(0, ids, torch.ones_like(ids, dtype=need.dtype))
        short = (host.lock_refs < need).nonzero().flatten()
        if short.numel():
            out.append(Finding("host_lock", int(ids.numel()), int(host.lock_refs.sum()),
                               f"pages the ledger holds a lock on that the pool does not "
                               f"count as locked: {short[:16].tolist()}"))
    return out


def _audit_adapters(mgr: Any) -> list[Finding]:
    out: list[Finding] = []
    reg = _real(mgr.registry)
    if not hasattr(reg, "id_of") or not hasattr(reg, "counts"):
        return out  # an engine's registry (SGLang's shape): nothing to compare by id
    for name, inst in mgr.adapters.items():
        i = mgr.ids.get(name)
        if inst.state == "ready":
            try:
                ok = reg.id_of(name) == i
            except Exception:
                ok = False
            if not ok:
                out.append(Finding("adapter", 1, 0, f"{name!r} is ready with id {i} but "
                                   "the registry does not have it under that id"))
        elif inst.state == "unloaded" and i is not None and i in reg.counts():
            out.append(Finding("adapter", 0, 1, f"{name!r} is unloaded but the registry "
                               f"still counts id {i}"))
    return out


_BUILTIN: dict[tuple[str, str], Audit] = {
    ("terminus.effects.disagg", "DisaggPrefill"): _audit_disagg,
    ("terminus.effects.sequence", "RunningBatch"): _audit_running,
    ("terminus.effects.tokenizer", "TokenizerSide"): _audit_tokenizer,
    ("terminus.effects.prefetch", "PrefetchSite"): _audit_prefetch,
    ("terminus.effects.lora_adapter", "AdapterManager"): _audit_adapters,
}
"""The drivers of this package, by (module, class name): the drivers import this module
for `sanitized`, so it names them rather than importing them."""
