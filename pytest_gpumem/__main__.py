"""`python -m pytest_gpumem compare|merge ...` (also installed as the `pytest-gpumem` command)."""

from __future__ import annotations

from pytest_gpumem.cli import main

raise SystemExit(main())
