"""Speculative decoding with DeepSeek's MTP (NextN) module, route capture exact under it.

| file        | holds                                                                                   |
| ----------- | --------------------------------------------------------------------------------------- |
| nextn.py    | NextNDraft (the MTP layer over the target's embedding and head), its weights, the      |
|             | construction-time check that no draft routing op can write a recorder's buffer          |
| drafter.py  | Drafter: the draft layer's latent cache, each request row's drafts, chain and extend    |
| verify.py   | acceptance: greedy longest prefix, rejection sampling under temperature                  |
| runner.py   | SpecRunner: one step (chain, target verify, acceptance, draft extend), one wait          |
| request_check.py | the sampling options a speculative engine refuses (penalties, min_new_tokens)       |

What runs when (EngineConfig.speculative_algorithm set): every step of a decoding request is a verify of its last
token and d' <= speculative_num_steps drafts (Scheduler._draft_len); prefill chunks run as without speculation and
are followed by a draft extend over their rows. The scheduler keeps the accepted tokens, frees the rejected
positions' KV and tells route capture to drop their rows (RequestHooks.on_reject) before any reader sees them.

Not supported (each refused with a one-line error): CUDA graphs for the draft and verify forwards (they run eager;
graphs stay off by default with speculation), several processes (tp/dp/ep > 1), penalties and min_new_tokens.
The overlapped scheduler is off: a step needs the accepted lengths of the one before.
"""
