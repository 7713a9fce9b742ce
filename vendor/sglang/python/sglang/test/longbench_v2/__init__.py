"""LongBench-v2 auxiliary utilities and validation scripts."""
