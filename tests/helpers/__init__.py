"""Helpers shared by the test modules (fixtures stay in tests/conftest.py)."""
