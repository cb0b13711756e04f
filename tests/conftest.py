"""Shared fixtures. Engines are expensive (~30 s each on CPU): one P and one D for the
whole session, shared by every integration test."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_dir() -> str:
    from kvhandoff.model import builtin_model_dir

    return str(builtin_model_dir())
