"""Torch resource pools that terminal transitions release, and their protocols.

The bottom layer: imports nothing from ``fsm``, ``states`` or ``effects``.
"""

from kernels import protocols
from kernels.batched import BatchRelease, gather_kv, release_batch
from kernels.errors import (
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
from kernels.host import HostPagePool, Prefetch
from kernels.kv import KVSnapshot, TokenKVAllocator
from kernels.lora import LoRAAdapter, LoRARegistry
from kernels.mamba import MambaStatePool
from kernels.metadata import MetadataSlot, MetadataSlots
from kernels.req_table import ReqToTokenTable

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
]
