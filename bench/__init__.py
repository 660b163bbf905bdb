"""r3trace's benchmarks: scripts that measure the claims of BENCHMARKS.md, and the sample model's tools.

Every script runs as `python -m bench.<name>` from the repository root and has a `--smoke` mode (CPU, tiny shapes,
Triton kernels in the interpreter) that tests/bench/test_smoke.py runs in `make test`. bench/README.md lists them.
Shared pieces: inputs.py (paged MLA decode inputs, MoE routes; the kernel tests build theirs with it too),
timing.py (timers and ceilings), decode_rate.py (the engine benches' checkpoint, prompts and decode rate),
tables.py (BENCHMARKS.md's tables from bench/results/latest.json), spawn.py (rank processes and a free port; the
tests spawn theirs with it too), tiny_models.py (tiny random DeepSeek checkpoints and a direct forward; engine_gpu.py
and the engine tests). Tests may import bench; bench never imports tests.
"""

import os
import sys

# `python -m bench.<name>` puts the repository root first on sys.path, where kernels/ (imported as r3trace.kernels)
# shadows Hugging Face's top-level `kernels`, which transformers >= 5.25 imports with its models: engine_gpu's
# transformers baseline failed with "cannot import name 'CUDAProperties' from 'kernels'". The root goes last, where
# pytest's --import-mode=append puts it (pyproject.toml), so `bench.*` and `tests.*` still resolve.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0] or ".") == _ROOT:
    sys.path.append(sys.path.pop(0))
