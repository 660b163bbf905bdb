"""The multi-GPU bench: the parallel test matrix over NCCL, and tokens/s per GPU against one GPU.

    python -m bench.multigpu --gpus 2 --out $OUT/multigpu-nvidia-h200-x2.json
    python -m bench.multigpu --smoke        # the same code on the CPU: gloo, a world of 2, tiny sizes

| file           | holds                                                                                        |
| -------------- | -------------------------------------------------------------------------------------------- |
| __main__.py    | the command: NVLink multicast off first, then the matrix, throughput, the result file, tables |
| env.py         | the three multicast settings, and each rank process's environment read back from /proc       |
| cases.py       | the matrix's cases (layout, exact or default mode, redundant experts, rebalance) and refusals |
| workload.py    | the requests every case runs (tests/engine/test_parallel_exact.py runs them too), trace check |
| compare.py     | a case's results against the one-process run: bitwise (exact), near-tie counted (default)    |
| placement.py   | redundant experts: a placement to rebalance to, the rebalance while requests run, physical ids |
| matrix.py      | the one-process references and one case from engine start to its record                     |
| throughput.py  | prefill and decode tokens/s of one layout, capture on and off                                |
| checkpoints.py | the random V3-shaped checkpoints the throughput part times                                   |
| report.py      | markdown tables from the result dict, SGLang's anchors marked "not comparable"               |

Nothing here is imported by the engine; tests/engine imports workload.py, compare.py and placement.py.
"""
