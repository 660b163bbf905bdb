"""Speculative decoding with DeepSeek's MTP (NextN) module, route capture exact under it.

| file        | holds                                                                                   |
| ----------- | --------------------------------------------------------------------------------------- |
| nextn.py    | NextNDraft (the MTP layer over the target's embedding and head), its weights, the      |
|             | construction-time check that no draft routing op can write a recorder's buffer          |
| drafter.py  | Drafter: the draft layer's latent cache, each request row's drafts, chain and extend    |
| verify.py   | acceptance: greedy longest prefix, rejection sampling under temperature                  |
| schedule.py | VerifySchedule: a step's verify items and draft counts; accept: tokens kept under the stops |
| runner.py   | SpecRunner: one step (chain, target verify, acceptance, draft extend), one wait          |
| penalised.py | penalties, min_new_tokens and logit_bias on each verify row, as plain decoding applies them |
| graphs.py   | SpecGraphs: the chain, verify and extend forwards as CUDA graphs, one set per batch size, |
|             | and a greedy step's whole work as one graph (greedy_step.py)                             |
| greedy_step.py | GreedyStep: chain drafts, verify, acceptance and draft extend on the graphs' static inputs |

What runs when (EngineConfig.speculative_algorithm set): every step of a decoding request is a verify of its last
token and d' <= speculative_num_steps drafts (VerifySchedule.draft_len); prefill chunks run as without speculation
and are followed by a draft extend over their rows. The scheduler keeps the accepted tokens, frees the rejected
positions' KV and tells route capture to drop their rows (RequestHooks.on_reject) before any reader sees them.

CUDA graphs (EngineConfig.graph_batch_sizes; the default ladder stops at the verifies of d + 1 tokens one step's
budget holds): a step whose every request verifies d drafts replays one graph when every request is greedy, else the
three; any other step runs eager, the reference (graphs.py), but for its verifies' chain drafts on the chain graphs.
Not supported (refused with a one-line error): several processes (tp/dp/ep > 1).
The overlapped scheduler is off: a step needs the accepted lengths of the one before.
"""
