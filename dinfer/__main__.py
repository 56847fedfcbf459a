"""`python -m dinfer ...`: the same command as `dinfer ...`."""

from .cli import main

raise SystemExit(main())
