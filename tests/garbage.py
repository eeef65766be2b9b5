"""`cyclic_garbage()`: what only the cyclic collector would have freed, of the objects a
block made. A driver that leaves a reference cycle behind keeps what it forgot in memory
until the collector runs, and has every collector pass walk it until then."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def cyclic_garbage() -> Iterator[list[Any]]:
    """The collector is off inside the block (nothing it made is freed by a pass); at
    the end, the list holds every object that only a pass would free."""
    enabled = gc.isenabled()
    gc.disable()
    gc.collect()  # garbage from before the block is not the block's
    found: list[Any] = []
    try:
        yield found
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
