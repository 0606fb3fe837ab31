"""Benchmarks: `kvscope bench [--quick]` runs them all (bench/run_all.py)."""
