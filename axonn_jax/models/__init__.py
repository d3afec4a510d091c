"""Reference models written in this repository (used by tests, examples, benchmarks)."""
