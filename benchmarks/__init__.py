"""Benchmarks for dynserve, kept apart from the tests. Run each as a module: `python -m benchmarks.engine`.

Every benchmark fixes its seeds, warms up before timing, measures a baseline in the same run, and prints
one JSON object (with the commit and machine) as its last stdout line; see `benchmarks/_common.py`.
"""
