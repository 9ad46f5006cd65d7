"""Fixtures of the Flower tests (the helpers themselves live in flower_support.py)."""

from flower_support import flower_tmp  # noqa: F401 - a fixture
