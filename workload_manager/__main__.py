"""Entry point of `python -m workload_manager`."""

from workload_manager.cli import main

raise SystemExit(main())
