"""The printed report of `r3trace eplb` (commands/eplb.py): windows, backtest, the plan and its layout, scores in-sample
and held out (and of --previous kept as is), the worst layers, churn."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

    from r3trace.eplb.report import Report
    from r3trace.eplb.token_mix import Source

# the in-sample / held-out table's rows: label ({} the node limit), Score field, format
SCORE_ROWS = (("balancedness (even split)", "balancedness_even", ".4f"),
              ("balancedness (replayed)", "balancedness_replay", ".4f"),
              ("balancedness (SGLang static)", "balancedness_static", ".4f"),
              ("balancedness (SGLang dynamic)", "balancedness_dynamic", ".4f"),
              ("nodes per token", "nodes_mean", ".3f"), ("over node limit ({})", "over_limit_share", ".2%"),
              ("tokens replayed", "tokens", ","))


def _repeated_line(tokens: np.ndarray | None, which: str) -> str:
    """tokens [T, L, K] replayed from a window -> a warning where some repeat an expert in a top-K (a router picks K
    distinct ones: broken captures, e.g. the all-zero rows of slots a capture never wrote), else ''."""
    from r3trace.trace.batch import repeated_tokens

    if tokens is None:
        return ""
    bad, zero = repeated_tokens(tokens)  # [T], [T]
    if not bad.any():
        return ""
    zeros = int(zero.sum())
    return (f"warning: {int(bad.sum()):,} of the {len(tokens):,} {which} tokens replayed repeat an expert in a "
            f"top-{tokens.shape[2]} ({zeros:,} all zeros): broken captures, which the heat counts as routes "
            "(`r3trace stats` counts such rows over the run; `r3trace ingest --drop-repeated` leaves them out)")


def _f(v: float | None, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def report_lines(rep: Report, cluster: object, layer_ids: tuple[int, ...], previous: str | None,
                 asked_windows: int | None = None) -> list[str]:
    """The printed report: windows (and why fewer than --windows asked), backtest, the plan, its layout, scores
    in-sample vs held out, worst layers, churn."""
    from r3trace.eplb.origins import origins_line
    from r3trace.eplb.placement import Cluster

    assert isinstance(cluster, Cluster)
    held = rep.held_out.label if rep.held_out is not None else rep.held_out_note
    plural = "" if rep.history_windows == 1 else "s"
    fewer = "" if asked_windows is None or rep.history_windows >= asked_windows else (
        f" (of --windows {asked_windows}: a history window is whole rollup windows, or forwards, and empty ones are "
        "dropped)")
    out = [f"train: {rep.train.label}, heat from {rep.source} in {rep.history_windows} history window{plural}{fewer}",
           f"held out: {held}"]
    out += [line for line in (_repeated_line(rep.train_tokens, "training"), _repeated_line(rep.held_tokens, "held-out"))
            if line]
    bt = rep.backtest
    if bt is not None and bt.chosen is None:
        out.append(f"auto: {bt.note}")
    elif bt is not None:
        folds = max((len(c.folds) for c in bt.candidates), default=0)
        out += [f"auto: backtest over {folds} folds: each history window of {bt.validate} scored from a plan on "
                f"the windows before it (the first fit on {bt.fit}); means over the folds",
                f"  {'policy':<13}{'forecast':<10}{'bal. even':>10}{'bal. replay':>13}{'bal. static':>13}"
                f"{'bal. dynamic':>14}{'nodes/token':>13}"]
        for c in bt.candidates:
            if not c.folds:
                out.append(f"  {c.policy:<13}{c.forecast:<10}  cannot plan: {c.note}")
                continue
            out.append(f"  {c.policy:<13}{c.forecast:<10}{_f(c.mean('balancedness_even')):>10}"
                       f"{_f(c.mean('balancedness_replay')):>13}{_f(c.mean('balancedness_static')):>13}"
                       f"{_f(c.mean('balancedness_dynamic')):>14}{_f(c.mean('nodes_per_token'), '.3f'):>13}")
        out += [f"  rule: {bt.rule}", f"auto chose {rep.policy} + {rep.forecast}"]
    out.append(f"{rep.policy} + {rep.forecast} forecast: P={cluster.num_slots} on {cluster.num_gpus} GPUs / "
               f"{cluster.num_nodes} nodes, max replicas {int(rep.placement.logcnt.max())}")
    keep = rep.layout is not None and rep.layout.name == "groups_on_nodes"  # --keep-groups
    if rep.load_source is not None:
        out.append(load_source_line(rep.load_source, rep.mix_used, keep))
    n_layers = rep.placement.phy2log.shape[0]
    if rep.layout is not None:
        out.append(f"layout: {rep.layout.name}: {rep.layout.reason}; {rep.spread_layers} of {n_layers} layers "
                   "have an expert with replicas on more than one node")
    if rep.origins is not None:
        out.append(origins_line(rep.origins, rep.churn is not None, "hierarchical" if keep else "global"))
    h, kept = rep.held, rep.kept_in_sample
    out.append(f"{'':<30}{'in-sample':>12}{'held out':>12}" + (f"{'--previous, kept as is':>26}" if kept else ""))
    for name, field, spec in SCORE_ROWS:
        def cell(score: object, width: int, field: str = field, spec: str = spec) -> str:
            return format(_f(None if score is None else getattr(score, field), spec), f">{width}")

        line = f"{name.format(cluster.node_limit):<30}{cell(rep.in_sample, 12)}{cell(h, 12)}"
        if kept is not None:
            line += f"{cell(kept, 14)}{cell(rep.kept_held, 12)}"
        out.append(line)
    if rep.held_bound is not None and h is not None:
        out.append(f"best on the held-out window (every slot one expert): balancedness (even split) <= "
                   f"{rep.held_bound:.4f} for any placement, in hindsight; this plan {h.balancedness_even:.4f}")
    if rep.in_sample.static is not None:
        out.append(f"SGLang static and dynamic dispatch: {rep.static_sources}")
    worst = h if h is not None else rep.in_sample
    layers = _worst(worst, layer_ids, rep.dispatch)
    if layers:
        out.append(f"worst layers ({'held out' if h is not None else 'in-sample'}, {rep.dispatch} dispatch): "
                   f"{layers}")
    if rep.churn is not None:
        moved = round(rep.churn * rep.placement.phy2log.size)
        out.append(f"churn vs {previous}: {rep.churn:.2%} of {rep.placement.phy2log.size:,} slots changed expert "
                   f"({moved:,})")
    if rep.replan:
        out.append(f"re-plan: {rep.replan}")
    gain = _replan_gain(rep)
    if gain:
        out.append(gain)
    return out


def _replan_gain(rep: Report) -> str:
    """The plan against --previous kept as is, on the held-out window (else in-sample), under the dispatch the report
    judges by (the even split without tokens): what moving the churned slots buys; '' without --previous."""
    plan, kept = (rep.held, rep.kept_held) if rep.kept_held is not None else (rep.in_sample, rep.kept_in_sample)
    if kept is None or plan is None:
        return ""
    when = "held out" if rep.kept_held is not None else "in-sample (no held-out window)"
    how = rep.dispatch if plan.replay is not None else "even split"
    gain = plan.judged(rep.dispatch) - kept.judged(rep.dispatch)
    text = f"re-plan vs keeping --previous, {when}, {how}: balancedness {gain:+.4f}"
    if plan.nodes_mean is not None and kept.nodes_mean is not None:
        text += f", nodes per token {plan.nodes_mean - kept.nodes_mean:+.3f}"
    return text


def _worst(s: object, layer_ids: tuple[int, ...], dispatch: str, k: int = 3) -> str:
    """The k lowest balancedness layers under `dispatch` (the even split when there are no tokens) and the k highest
    nodes per token, by model layer id."""
    import numpy as np

    from r3trace.eplb.evaluate import Score

    assert isinstance(s, Score)
    bal = s.per_layer(dispatch)  # type: ignore[arg-type]
    order = [i for i in np.argsort(np.nan_to_num(bal, nan=2.0), kind="stable")[:k] if not np.isnan(bal[i])]
    text = "balancedness " + ", ".join(f"layer {layer_ids[i]} {bal[i]:.4f}" for i in order)
    if s.nodes is not None:
        top = np.argsort(-s.nodes, kind="stable")[:k]
        text += "; nodes per token " + ", ".join(f"layer {layer_ids[i]} {s.nodes[i]:.3f}" for i in top)
    return text


def load_source_line(src: Source, used: bool, keep_groups: bool = False) -> str:
    """What ours forecast from (token_mix.planning_loads, plan_forecast.forecasts_from_mix), the kinds of token AIC
    found and the backtest's errors; keep_groups: `--keep-groups`, whose forecast never reads the mix."""
    from r3trace.eplb.token_mix import MIN_GAIN
    if not src.aic:
        return "forecast from: the raw windows (fewer than 3 history windows with routes: no token mix to fit)"
    kinds = min(src.aic, key=lambda d: src.aic[d])
    errs = f"AIC over {', '.join(str(d) for d in src.aic)} kinds; backtest squared rate error: " + ", ".join(
        f"{k} {v:.4g}" for k, v in src.errors.items())
    if src.name == "raw":
        why = "one kind of token by AIC" if kinds == 1 else f"no mix forecast the next window > {MIN_GAIN:.0%} better"
        return f"forecast from: the raw windows ({why}; {errs})"
    if keep_groups:
        return (f"forecast from: the raw windows (groups kept: {src.name} serves only the early drift test on three "
                f"windows; {errs})")
    if not used:
        return (f"forecast from: the raw windows (the history does not drift, and a long memory averages the windows' "
                f"mixes out; {src.name} would forecast where it drifts; {errs})")
    return f"forecast from: each history window at the long-run mix of its kinds of token ({src.name}; {errs})"
