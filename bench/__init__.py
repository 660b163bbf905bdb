"""r3trace's benchmarks: scripts that measure the claims of BENCHMARKS.md, and the sample model's tools.

Every script runs as `python -m bench.<name>` from the repository root and has a `--smoke` mode (CPU, tiny shapes,
Triton kernels in the interpreter) that tests/bench/test_smoke.py runs in `make test`. bench/README.md lists them.
Shared pieces: inputs.py (paged MLA decode inputs, MoE routes; the kernel tests build theirs with it too),
timing.py (timers and ceilings), decode_rate.py (the engine benches' checkpoint, prompts and decode rate),
tables.py (BENCHMARKS.md's tables from bench/results/latest.json).
"""
