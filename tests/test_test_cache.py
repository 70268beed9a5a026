"""The suite runs against a cache folder of its own, never the user's (tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

from hamburger.model.base import cache_dir


def test_the_suite_uses_a_temporary_cache_folder():
    root = cache_dir()
    assert root is not None and root == Path(os.environ["HAMBURGER_CACHE"])
    assert root.name.startswith("hamburger-test-cache-"), root
    assert Path("~/.cache/hamburger").expanduser().resolve() != root.resolve()
