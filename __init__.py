"""Terminus: declared finite-state machines for the lifecycle of LLM-serving requests.

The repository root is this package; its folders are the subpackages:

- `terminus.fsm`: the generic engine (declaration, compiled tables, ledger, release
  plans, batched stepping) and its review tools (diagrams, coverage plugin, paths);
- `terminus.states`: the declared machines of LLM serving;
- `terminus.effects`: release plans bound to the pools, and the drivers a serving engine
  embeds (`terminus.effects.sim` holds the reference simulator);
- `terminus.kernels`: torch pools, the LoRA registry, batched release, collectives.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("terminus-fsm")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
