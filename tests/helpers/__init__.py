"""Helpers shared by the tests (imported as ``tests.helpers.<module>``; fixtures live in the
``conftest.py`` files): constants, functions that run the CLI or read what a run left, task
sources and test task modules."""
