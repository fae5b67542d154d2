"""The allocator's model's tests (a package: its conftest.py and the suite's are two modules to mypy)."""
