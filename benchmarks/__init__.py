"""Benchmarks of rlcomm against the plain torch.distributed calls it wraps.

``python -m benchmarks [--quick] [--only NAME[,NAME]]``; see ``benchmarks/__main__.py``.
Every comparison is measured in the same run against its reference, on real processes, and
reported as a ratio (rlcomm / reference) with its median, min and max over repetitions.
"""
