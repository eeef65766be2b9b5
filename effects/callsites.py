"""Every call that leaves the engine, in one registry, and faults injected at each.

A call site is `(resource, method)`: the role of the object a driver calls (its
`transport`, its KV pool `kv`, the client `sink`, ...) and the method it calls there,
with its `kind` (what a fault there means), `where` (the driver methods and release
effects that call it) and `error` (the exception the real resource raises, so the
injected fault takes the path a real one takes):

    kind          resources
    transport     transport (KV sender), scheduler (the tokenizer's scheduler link)
    collective    collectives (torch.distributed all-reduce and barrier)
    registry      lora_registry (tokenizer side), adapter_registry (adapter manager)
    tokenizer     tokenizer
    allocator     kv, mamba, table, metadata, host, host_prefetch
    cache_insert  cache (the disagg prefix cache), insert (the prefetch host cache)
    stream        sink (the client stream), on_retired (the scheduler's retire callback)

`FaultPlan` and `proxy` wrap resources so that a test (or the simulator) records every
call made on them and makes one registered call site raise once; a call on a proxied
resource that no registered site names raises `UnregisteredCallSite` at once, so a new
call site fails the suite until it is listed here (or, for a user's own driver or
resource, with `register_call_site`).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple

from terminus.kernels.collective import CollectiveError

from .transport import TransportError

__all__ = [
    "CALL_SITES",
    "KINDS",
    "RELEASES",
    "CallSite",
    "FaultPlan",
    "InjectedFault",
    "UnregisteredCallSite",
    "call_sites",
    "proxy",
    "register_call_site",
]

RELEASES = frozenset({"free", "release", "release_nowait", "terminate", "unlock", "take"})
"""Methods that give a unit back: a fault there leaves exactly that call's units held
(the error names them); every other unit is still freed."""

KINDS = ("transport", "collective", "registry", "tokenizer", "allocator", "cache_insert",
         "stream")
"""What a call site's fault stands for (`CallSite.kind`)."""


class CallSite(NamedTuple):
    """One call that leaves the engine."""

    kind: str
    resource: str
    method: str
    where: str
    error: type[BaseException] = RuntimeError


def _c(kind: str, resource: str, methods: str, where: str,
       error: type[BaseException] = RuntimeError) -> list[CallSite]:
    return [CallSite(kind, resource, m, where, error) for m in methods.split()]


CALL_SITES: tuple[CallSite, ...] = tuple([
    # -- disaggregated prefill (effects.disagg.DisaggPrefill) --------------------------
    *_c("transport", "transport", "bootstrap init", "DisaggPrefill.bootstrap", TransportError),
    *_c("transport", "transport", "send", "DisaggPrefill.result", TransportError),
    *_c("transport", "transport", "poll", "DisaggPrefill.poll_transfer", TransportError),
    *_c("transport", "transport", "abort", "DisaggPrefill.abort; plan release_aborted "
        "(sender_abort, best-effort)", TransportError),
    *_c("allocator", "kv", "alloc", "DisaggPrefill.schedule"),
    *_c("allocator", "kv", "free", "release effect free_kv; insert_kv_into_cache when the "
        "cache refused; PrefixCache.evict"),
    *_c("allocator", "mamba", "alloc available_size", "DisaggPrefill.schedule; "
        "RunningBatch.admit"),
    *_c("allocator", "mamba", "free", "release effect free_mamba; release_batch"),
    *_c("allocator", "table", "alloc", "DisaggPrefill.schedule; RunningBatch.admit"),
    *_c("allocator", "table", "write", "DisaggPrefill.schedule"),
    *_c("allocator", "table", "free", "release effect free_req_slot; release_batch"),
    *_c("allocator", "metadata", "alloc", "DisaggPrefill.bootstrap (MetadataSlot.take)"),
    *_c("allocator", "metadata", "free", "release effect free_metadata "
        "(MetadataSlot.release)"),
    *_c("allocator", "host", "prefetch", "DisaggPrefill.add; PrefetchSite.start"),
    *_c("allocator", "host", "lock", "PrefetchSite.queue"),
    *_c("allocator", "host", "unlock", "release effect unlock_anchor"),
    *_c("allocator", "host", "free", "release effect hand_to_cache when the cache refused"),
    *_c("allocator", "host_prefetch", "advance", "DisaggPrefill.advance_prefetch; "
        "PrefetchSite.transfer"),
    *_c("allocator", "host_prefetch", "stop", "PrefetchSite.abort_steps (drain)"),
    *_c("allocator", "host_prefetch", "terminate release", "release effects "
        "release_hicache, free_completed_pages"),
    *_c("allocator", "host_prefetch", "take", "release effect hand_to_cache"),
    *_c("cache_insert", "cache", "insert", "release effect insert_kv_into_cache"),
    *_c("stream", "sink", "put", "the stream_terminal effects of every request plan "
        "(best-effort)", ConnectionError),
    # -- tokenizer side (effects.tokenizer.TokenizerSide, effects.request) -------------------
    *_c("registry", "lora_registry", "acquire", "TokenizerSide.submit, _prepare_group"),
    *_c("registry", "lora_registry", "release release_nowait", "release effect "
        "release_lora"),
    *_c("tokenizer", "tokenizer", "tokenize", "TokenizerSide.submit, _prepare_group"),
    *_c("transport", "scheduler", "send", "TokenizerSide.submit (_run_request), _start",
        ConnectionError),
    *_c("transport", "scheduler", "abort", "plan release_aborted (tell_scheduler_abort, "
        "best-effort)", ConnectionError),
    # -- running batch (effects.sequence.RunningBatch) ----------------------------------------
    *_c("allocator", "kv", "alloc", "RunningBatch.append_kv"),
    *_c("stream", "on_retired", "__call__", "RunningBatch's release effect (after the "
        "pools got the rows back)"),
    # -- prefetch across ranks (effects.prefetch) ---------------------------------------------
    *_c("collective", "collectives", "reduce_max barrier", "prefetch.drive (PrefetchSite."
        "abort, retry)", CollectiveError),
    *_c("cache_insert", "insert", "__call__", "release effect hand_to_cache"),
    # -- adapter manager (effects.lora_adapter.AdapterManager) -------------------------------
    *_c("registry", "adapter_registry", "register upsert unregister wait_for_unload",
        "AdapterManager.load, upsert, unload, wait_unloaded"),
])
"""The engine's own call sites (a (resource, method) pair may be listed for two drivers)."""

_EXTRA: list[CallSite] = []


def register_call_site(kind: str, resource: str, method: str, where: str,
                       error: type[BaseException] = RuntimeError) -> CallSite:
    """List a call site of your own driver or resource, so the fault fixture and the
    recording proxies know it."""
    if kind not in KINDS:
        raise ValueError(f"call-site kind {kind!r} is not one of {', '.join(KINDS)}")
    site = CallSite(kind, resource, method, where, error)
    _EXTRA.append(site)
    return site


def call_sites(kind: str | None = None) -> list[CallSite]:
    """Every registered call site, one per (resource, method), of `kind` if given."""
    seen: dict[tuple[str, str], CallSite] = {}
    for s in CALL_SITES:
        seen.setdefault((s.resource, s.method), s)
    for s in _EXTRA:  # a later registration of one (resource, method) replaces it
        seen[(s.resource, s.method)] = s
    return [s for s in seen.values() if kind is None or s.kind == kind]


class InjectedFault(Exception):
    """Mixed into the error a faulted call site raises (`site`: which one)."""

    site: CallSite


class UnregisteredCallSite(AssertionError):
    """A proxied resource was called at a (resource, method) no registered site names."""


_ERRORS: dict[type[BaseException], type[BaseException]] = {}


def _injected(site: CallSite, error: type[BaseException] | None = None) -> BaseException:
    base = site.error if error is None else error
    cls = _ERRORS.get(base)
    if cls is None:
        cls = type(f"Injected{base.__name__}", (InjectedFault, base), {})
        _ERRORS[base] = cls
    msg = (f"injected fault at {site.resource}.{site.method} ({site.kind}; called by "
           f"{site.where})")
    if issubclass(base, CollectiveError):
        err: Any = cls("injected fault", site.method, "injected", [0], RuntimeError(msg))
    else:
        err = cls(msg)
    err.site = site
    return err


class FaultPlan:
    """Which call site raises (`arm`), how often (`times`), and what was called.

    `calls` counts every call made through a proxy, by (resource, method); `fired` the
    faults raised. `strict`: a call no registered site names raises
    `UnregisteredCallSite`. `count=False` (a simulation that only injects faults): no
    call is counted (`calls` stays empty), and a proxied method of a registered site
    that is not armed is the resource's own, called without a wrapper in between;
    `arm` puts the recording wrapper back for that site until its faults have fired.
    So under `count=False` a caller reads a method through the proxy at each call: a
    method read (and kept) before `arm` is the resource's own and never faults (the
    fault fires at the next call read through the proxy). A call no registered site
    names is still checked (and refused when `strict`).
    """

    def __init__(self, strict: bool = True, *, count: bool = True) -> None:
        self.strict = strict
        self.count = count
        self.calls: Counter[tuple[str, str]] = Counter()
        self.fired: list[CallSite] = []
        self.fired_calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        """Each faulted call as (the resource's method, its arguments): calling it again
        frees what a refused free did not."""
        self._armed: dict[tuple[str, str], int] = {}
        self._errors: dict[tuple[str, str], type[BaseException] | None] = {}
        self._known = {(s.resource, s.method): s for s in call_sites()}
        self._proxies: weakref.WeakSet[_Proxy] = weakref.WeakSet()
        """The proxies made over this plan (`count=False`: `_rebind` reaches them)."""

    def arm(self, site: CallSite, times: int = 1,
            error: type[BaseException] | None = None) -> None:
        """Make `site` raise on its next `times` calls: an `InjectedFault` that is also
        a `site.error`, or an `error` instead (what a real resource raises that its
        protocol does not name: a sender's `ConnectionError`, an allocator's
        `MemoryError`)."""
        if error is not None and not (isinstance(error, type)
                                      and issubclass(error, Exception)):
            raise TypeError(f"FaultPlan.arm: error must be an Exception class, got "
                            f"{error!r}")
        key = (site.resource, site.method)
        self._armed[key] = times
        self._errors[key] = error
        self._rebind(key)

    def _rebind(self, key: tuple[str, str]) -> None:
        """`count=False`: the method of `key` is read again at its next call through any
        proxy of this plan (the recording wrapper while the site is armed, the
        resource's own method once it is not)."""
        if self.count:
            return  # every known method keeps its recording wrapper
        resource, method = key
        for p in list(self._proxies):
            if p._resource == resource:
                p.__dict__.pop(method, None)

    def call(self, resource: str, method: str, args: tuple[Any, ...] = (),
             fn: Callable[..., Any] | None = None) -> None:
        """Record one call; raise the injected fault when that site is armed."""
        key = (resource, method)
        if self.count:
            self.calls[key] += 1
        site = self._known.get(key)
        if site is None:
            self._known = {(s.resource, s.method): s for s in call_sites()}
            site = self._known.get(key)
        if site is None:
            if self.strict:
                raise UnregisteredCallSite(
                    f"{resource}.{method} left the engine but no registered call site "
                    "names it; list it in terminus.effects.callsites.CALL_SITES (or "
                    "register_call_site for your own driver)")
            return
        left = self._armed.get(key, 0)
        if left > 0:
            if left == 1:  # used up: a proxy's fast path finds no entry for it
                del self._armed[key]
                self._rebind(key)
            else:
                self._armed[key] = left - 1
            self.fired.append(site)
            if fn is not None:
                self.fired_calls.append((fn, args))
            raise _injected(site, self._errors.get(key))


class _Proxy:
    # A method's recording wrapper is made at its first use and kept in the proxy's own
    # __dict__ (later calls find it without `__getattr__`); setting an attribute
    # through the proxy drops them all, so a method replaced that way is read again
    # (replace a method through the proxy, not on the object behind it).
    # A plan that does not count (`FaultPlan(count=False)`) keeps the resource's own
    # method there for a registered site that is not armed: nothing to record, nothing
    # to raise (`FaultPlan._rebind` drops it when the site is armed, and again when its
    # faults have fired).
    __slots__ = ("__dict__", "__weakref__", "_plan", "_resource", "_target", "_wrap")

    def __init__(self, target: Any, resource: str, plan: FaultPlan,
                 wrap: dict[str, str]) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_resource", resource)
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "_wrap", wrap)
        plan._proxies.add(self)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        if name.startswith("_") or not callable(value):
            return value
        plan, resource = self._plan, self._resource
        inner = self._wrap.get(name)
        key = (resource, name)
        armed = plan._armed  # (changed in place, never replaced)
        # Registered sites are never dropped (`call_sites` only adds), so one known
        # now stays known; an unknown one always takes `FaultPlan.call`, which looks
        # again (and raises in a strict plan).
        known = key in plan._known

        if known and inner is None and plan.count:
            def call(*args: Any, **kwargs: Any) -> Any:
                # The common case in a few dict operations: a known site, not armed
                # (what `FaultPlan.call` does for it: counted in the plan's `calls` of
                # now); else `FaultPlan.call`.
                if key in armed:
                    plan.call(resource, name, args, value)
                else:
                    plan.calls[key] += 1
                return value(*args, **kwargs)
        elif known and inner is None and key not in armed:  # counting nothing
            self.__dict__[name] = value  # the resource's own: nothing to record
            return value
        else:
            def call(*args: Any, **kwargs: Any) -> Any:
                # An unknown site (`FaultPlan.call` looks again, and raises in a strict
                # plan), a method whose result is proxied too, or an armed site of a
                # plan that counts nothing (until its faults fired: `_rebind`).
                plan.call(resource, name, args, value)
                out = value(*args, **kwargs)
                if inner is not None and out is not None:
                    return _Proxy(out, inner, plan, {})
                return out

        self.__dict__[name] = call
        return call

    @property
    def __wrapped__(self) -> Any:
        """The resource itself (audits read it without recording a call)."""
        return self._target

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)
        self.__dict__.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._plan.call(self._resource, "__call__", args, self._target)
        return self._target(*args, **kwargs)


def proxy(target: Any, resource: str, plan: FaultPlan,
          returns: dict[str, str] | None = None) -> Any:
    """`target` seen through `plan`: each method call is recorded (and may raise).

    A method is looked up on `target` at its first use through the proxy and kept;
    replace one by setting it on the proxy (which sets it on `target`), not on `target`
    behind the proxy's back. `returns` proxies what some methods return under another
    resource name (the `Prefetch` of `host.prefetch` as ``"host_prefetch"``).
    """
    return _Proxy(target, resource, plan, dict(returns or {}))


def faulty(fn: Callable[..., Any], resource: str, plan: FaultPlan) -> Any:
    """A plain callable (an `insert` or `on_retired` callback) seen through `plan`."""
    return _Proxy(fn, resource, plan, {})
