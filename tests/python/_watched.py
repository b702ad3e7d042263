"""The load journal held for a test module whose tests load before an explicit attach."""

from __future__ import annotations

import pytest

import trainsan


@pytest.fixture(autouse=True)
def _watched_loads():
    """These tests judge loads made before an explicit attach: journaled as trainsan.watch_loads()
    journals them (`import trainsan` installs nothing: Note [Patches]; test_patches.py covers an
    attach without it)."""
    with trainsan.watch_loads():
        yield
