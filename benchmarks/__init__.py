"""What a user runs to measure: each benchmark is a module run from the checkout's root
(``python -m benchmarks.bench_training``), sharing ``benchmarks.common``; its report of
record is ``benchmarks/results/<benchmark>/<device>.json``."""
