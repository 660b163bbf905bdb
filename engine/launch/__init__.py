"""Launching a multi-process engine: one process per TP rank, a front end that looks like one process.

| module        | holds                                                                            |
| ------------- | -------------------------------------------------------------------------------- |
| config.py     | LaunchConfig: tp / dp / ep sizes, the DP load-balance method, collective timeout  |
| controller.py | DpController: which DP rank runs a request (round robin, shortest queue, pinned)  |
| step_layout.py| step_layout / idle_batch: the per-forward DP layout hook (ModelRunner calls it)   |
| lockstep.py   | RankLoop: every rank's loop; messages broadcast, steps decided together           |
| worker.py     | rank_main: one spawned (or torchrun) rank: process group, EngineCore, RankLoop    |
| group.py      | WorkerGroup: the front end's side: submit, results, traces, watchdog              |
| members.py    | ProcessMember, ThreadMember: a rank as the watchdog sees it (alive, why it ended) |
| __main__.py   | torchrun entry: `torchrun --nproc-per-node N -m r3trace.engine.launch MODEL ...`  |
"""
