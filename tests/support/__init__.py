"""Helpers shared by test folders (tests/ is on sys.path through its conftest)."""
