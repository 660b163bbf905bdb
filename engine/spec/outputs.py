"""A speculative step's results on the host, split into each scheduled item's ReqOutput (SpecRunner.collect)."""

from __future__ import annotations

from ..step import ReqOutput, ScheduledReq, fill_input_logprobs, listed_entries, top_entries


def split_outputs(items: list[ScheduledReq], host: dict[str, list]) -> list[ReqOutput]:
    """Each request's share of the step's results."""
    outs: list[ReqOutput] = []
    lp_pos = sample_pos = 0
    for it in items:
        out = ReqOutput()
        lp_pos += fill_input_logprobs(out, it, host.get("in_lp", []), lp_pos,
                                      lambda j: (host["in_top_v"][j], host["in_top_i"][j]),
                                      lambda j: host["in_ids_lp"][j])
        if it.sample:
            k = it.req.logprob.top_num if it.req.logprob is not None else 0
            ids = it.req.logprob.token_ids if it.req.logprob is not None else ()
            n = host["counts"][sample_pos]
            toks = host["tokens"][sample_pos][:n]
            lps = host["next_lp"][sample_pos][:n] if it.req.logprob is not None else None
            top_list = ([top_entries(host["top_v"][sample_pos][j], host["top_i"][sample_pos][j], k) for j in range(n)]
                        if k else None)
            ids_list = [listed_entries(host["ids_lp"][sample_pos][j], ids) for j in range(n)] if ids else None
            if it.phase == "verify":
                out.next_tokens, out.next_logprobs, out.next_tops = toks, lps, top_list
                out.next_ids_lps = ids_list
            else:
                out.next_token = toks[0]
                out.next_logprob = None if lps is None else lps[0]
                out.next_top = None if top_list is None else top_list[0]
                out.next_ids_lp = None if ids_list is None else ids_list[0]
            sample_pos += 1
        outs.append(out)
    return outs
