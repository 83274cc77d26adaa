"""Side-by-side benchmarks: c10d (TCPStore), torch's built-in etcd-v2 (v2 API), our etcd-v2 and etcd-v3.

One entry point::

    python -m benchmarks.run            # full run (about 15 min on 2 cores)
    python -m benchmarks.run --quick    # smoke test (under 2 min), what .ci/run executes
    python -m benchmarks.run --scale    # B2 and B4 up to N = 1024, for a 16-core machine

Results (JSON, a markdown table, PNG plots, machine facts and versions) go to
``benchmarks/results/<mode>-<machine>/``. See ``benchmarks/run.py``.
"""
