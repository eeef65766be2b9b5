"""Errors raised by the kernel pools.

Every message says what was wrong and what to do about it. The classes carry the
offending values as attributes so that callers and tests need not parse messages.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "DoubleFree",
    "ForeignIndex",
    "KernelError",
    "LeakError",
    "PageLocked",
    "RegistryFull",
    "ReleaseUnderflow",
    "StaleSnapshot",
    "UnknownAdapter",
    "UnloadTimeout",
]

_SHOWN = 16


def _fmt(values: Sequence[int]) -> str:
    """Render at most 16 values, so a corrupt pool does not produce a megabyte message."""
    head = ", ".join(str(v) for v in values[:_SHOWN])
    more = f", ... ({len(values)} in all)" if len(values) > _SHOWN else ""
    return f"[{head}{more}]"


class KernelError(Exception):
    """Base class of every error raised by ``kernels``."""


class DoubleFree(KernelError):
    """Indices were freed that were already free (or twice in one call), or released
    again after a call that handed them over (``detail`` then says so, and what to do:
    the whole message after the pool's name)."""

    def __init__(self, pool: str, indices: Sequence[int], detail: str | None = None) -> None:
        self.pool = pool
        self.indices = list(indices)
        super().__init__(
            f"{pool}: " + (detail or (
                f"double free of {_fmt(self.indices)}: these were already free (or appear "
                "twice in one free). Each acquired index has exactly one release; find the "
                "second release path and remove it."))
        )


class ForeignIndex(KernelError):
    """Indices were freed that this pool never hands out (padding slot, out of range)."""

    def __init__(self, pool: str, indices: Sequence[int], valid: str) -> None:
        self.pool = pool
        self.indices = list(indices)
        super().__init__(
            f"{pool}: foreign index {_fmt(self.indices)}: this pool only hands out {valid}. "
            "Free only what alloc() returned from this same pool; never free the padding slot."
        )


class LeakError(KernelError, AssertionError):
    """``assert_full()`` found resources that were acquired and never released."""

    def __init__(
        self, pool: str, missing: int, sample: Sequence[int], unit: str = "indices"
    ) -> None:
        self.pool = pool
        self.missing = missing
        self.sample = list(sample)
        super().__init__(
            f"{pool}: {missing} {unit} still held, e.g. {_fmt(self.sample)}; "
            "some terminal path did not release what it owned."
        )


class StaleSnapshot(KernelError):
    """``restore_state`` got a snapshot that a later backup or ``clear()`` replaced."""


class PageLocked(KernelError):
    """A host page was freed while a lock reference still held it."""

    def __init__(self, pool: str, pages: Sequence[int]) -> None:
        self.pool = pool
        self.pages = list(pages)
        super().__init__(
            f"{pool}: cannot free locked pages {_fmt(self.pages)}; unlock() every lock "
            "reference first (the holder is still reading or writing them)."
        )


class UnknownAdapter(KernelError, KeyError):
    """A LoRA adapter name is not registered (never was, or was unregistered).

    ``detail``: the message, where the default (for a lookup or an acquire) does not fit
    the call that raised it.
    """

    def __init__(self, names: Sequence[str], detail: str | None = None) -> None:
        self.names = list(names)
        KernelError.__init__(
            self,
            detail or f"unknown LoRA adapter(s) {self.names}: register() or upsert() them "
            "first; nothing was acquired.",
        )

    def __str__(self) -> str:  # KeyError would quote the message otherwise
        return str(self.args[0])


class RegistryFull(KernelError):
    """The LoRA registry already holds ``capacity`` adapters."""


class ReleaseUnderflow(KernelError):
    """A LoRA release would drive a usage counter below zero."""

    def __init__(self, lora_id: int, count: int, releases: int) -> None:
        self.lora_id = lora_id
        self.count = count
        self.releases = releases
        super().__init__(
            f"release of LoRA id {lora_id} x{releases} would drive its counter below zero "
            f"(count is {count}); a reference was released twice or never acquired. "
            "Nothing was released."
        )


class UnloadTimeout(KernelError, TimeoutError):
    """``unload`` waited ``timeout`` seconds and the adapter's counter never reached zero."""

    def __init__(self, lora_id: int | str, name: str, count: int | None,
                 timeout: float) -> None:
        self.lora_id = lora_id
        self.name = name
        self.count = count
        held = (f"with count {count}: {count} in-flight reference(s) were never released"
                if count is not None else
                "with in-flight references never released (the registry cannot count them)")
        super().__init__(
            f"unload of LoRA id {lora_id} ({name!r}) timed out after {timeout:g}s {held}. "
            "The adapter stays unregistered; call wait_for_unload() again once they are."
        )
