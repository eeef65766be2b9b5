"""`python -m fsm` is the `terminus` command."""

import sys

from .cli import console

sys.exit(console())
