"""Entry point of `python -m agent` (the same as the `nvpair` console script)."""

from agent.cli.main import main

raise SystemExit(main())
