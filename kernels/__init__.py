"""Torch resource pools that terminal transitions release, and their protocols.

The bottom layer: imports nothing from ``fsm``, ``states`` or ``effects``.
"""

from terminus.kernels import protocols
from terminus.kernels.batched import BatchRelease, gather_kv, release_batch, repeat_rows
from terminus.kernels.errors import (
    DoubleFree,
    ForeignIndex,
    KernelError,
    LeakError,
    PageLocked,
    RegistryFull,
    ReleaseUnderflow,
    StaleSnapshot,
    UnknownAdapter,
    UnloadTimeout,
)
from terminus.kernels.host import HostPagePool, Prefetch
from terminus.kernels.kv import KVSnapshot, TokenKVAllocator
from terminus.kernels.lora import LoRAAdapter, LoRARegistry
from terminus.kernels.mamba import MambaStatePool
from terminus.kernels.metadata import MetadataSlot, MetadataSlots
from terminus.kernels.req_table import ReqToTokenTable

__all__ = [
    "BatchRelease",
    "DoubleFree",
    "ForeignIndex",
    "HostPagePool",
    "KVSnapshot",
    "KernelError",
    "LeakError",
    "LoRAAdapter",
    "LoRARegistry",
    "MambaStatePool",
    "MetadataSlot",
    "MetadataSlots",
    "PageLocked",
    "Prefetch",
    "RegistryFull",
    "ReleaseUnderflow",
    "ReqToTokenTable",
    "StaleSnapshot",
    "TokenKVAllocator",
    "UnknownAdapter",
    "UnloadTimeout",
    "gather_kv",
    "protocols",
    "release_batch",
    "repeat_rows",
]
