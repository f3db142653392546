"""mtp-bench: modes (modes.py), prompts, the roofline, widened models (widen.py), the run
(benchmark.py) and its report (report.py)."""
