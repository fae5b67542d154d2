"""The allocator's model is a library of its own: a script uses it without pytest, torch or the plugin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_allocator_model import lazy_names

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "allocator_model_script.py"
LOADED = (  # the example run as a script, then which of the three it imported
    "import sys, runpy; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
    "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'pytest', 'pytest_gpumem'}))"
)


def test_the_example_script_serves_requests_as_a_card_would_without_torch_or_pytest() -> None:
    # 3 x 12 MiB: a 12 MiB segment each (10 MiB or more: rounded to 2 MiB); the middle one freed; 20 MiB fits
    # no hole: a fourth segment. Allocated 12 + 12 + 20 = 44 MiB, reserved 3 x 12 + 20 = 56 MiB; with
    # expandable segments, 20 MiB pages: 36 MiB then 20 more past the hole map 3 pages, 60 MiB. Within 40 MiB
    # the cached 12 MiB segment is released first (torch's retry), and 24 + 20 MiB still do not fit.
    done = subprocess.run([sys.executable, "-c", LOADED, str(EXAMPLE)], capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["defaults", "allocated", "44.0", "MiB", "reserved", "56.0", "MiB"]
    assert lines[1].split() == ["expandable_segments:True", "allocated", "44.0", "MiB", "reserved", "60.0", "MiB"]
    assert lines[2].startswith("capacity 40 MiB: CUDA out of memory (allocator model). Tried to allocate 20.0 MiB.")
    assert "24.0 MiB is reserved by PyTorch" in lines[2]
    assert lines[-1] == "[]"


def test_a_lazy_public_name_is_imported_from_its_home_and_an_unknown_one_names_the_package() -> None:
    find = lazy_names("pkg", {"dumps": "json", "read": "json:loads"})
    assert find("dumps") is json.dumps and find("read") is json.loads
    with pytest.raises(AttributeError, match=r"^module 'pkg' has no attribute 'dump'$"):
        find("dump")
