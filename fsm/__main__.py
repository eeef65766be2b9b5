"""`python -m fsm` is the `terminus` command."""

import sys

from .cli import main

sys.exit(main())
