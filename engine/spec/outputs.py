"""A speculative step's results on the host, split into each scheduled item's ReqOutput (SpecRunner.collect)."""

from __future__ import annotations

from ..request import LogprobEntry
from ..step import ReqOutput, ScheduledReq


def split_outputs(items: list[ScheduledReq], host: dict[str, list]) -> list[ReqOutput]:
    """Each request's share of the step's results."""

    def tops(values: list[float], ids: list[int], k: int) -> list[LogprobEntry]:
        return [(v, i, None) for v, i in zip(values[:k], ids[:k], strict=True)]

    def listed(values: list[float], ids: tuple[int, ...]) -> list[LogprobEntry]:
        return [(v, i, None) for v, i in zip(values[: len(ids)], ids, strict=True)]

    outs: list[ReqOutput] = []
    lp_pos = sample_pos = 0
    for it in items:
        out = ReqOutput()
        k = it.req.logprob.top_num if it.req.logprob is not None else 0
        ids = it.req.logprob.token_ids if it.req.logprob is not None else ()
        n_lp = len(it.logprob_positions)
        if n_lp:
            out.input_logprobs = host["in_lp"][lp_pos : lp_pos + n_lp]
            if k:
                out.input_tops = [tops(host["in_top_v"][j], host["in_top_i"][j], k)
                                  for j in range(lp_pos, lp_pos + n_lp)]
            if ids:
                out.input_ids_lps = [listed(host["in_ids_lp"][j], ids) for j in range(lp_pos, lp_pos + n_lp)]
            lp_pos += n_lp
        if it.sample:
            n = host["counts"][sample_pos]
            toks = host["tokens"][sample_pos][:n]
            lps = host["next_lp"][sample_pos][:n] if it.req.logprob is not None else None
            top_list = ([tops(host["top_v"][sample_pos][j], host["top_i"][sample_pos][j], k) for j in range(n)]
                        if k else None)
            ids_list = [listed(host["ids_lp"][sample_pos][j], ids) for j in range(n)] if ids else None
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
