"""PlannerConfig: every knob of our placement planner (planner.py), each with the measurement that set it.

Frozen and passed down: planner.plan and the re-plan helpers (replan.py) read it, nothing else holds one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from r3trace.eplb.placement import PlacementError


@dataclass(frozen=True)
class PlannerConfig:
    # Weight of the newest window in the forecast; a fixed 0.35 (~5 windows of memory) lost to DeepSeek's global
    # policy on 8 summed windows under slow drift and would lose to the newest window alone under fast drift
    ema_alpha: float | None = None  # None: chosen per plan by backtest on the history (choose_alpha)
    # a re-plan the backtest calls still (not drifting) takes the longest memory whose backtest error is within
    # alpha_tie of the best weight's: squared error in rates weighs every expert alike and ranks near weights by
    # noise, while the max GPU load follows the hot experts, which a longer memory forecasts with less noise. Over
    # bench/eplb_matrix.py's 118 cells (yes / tie / no against the better global): 0 -> 35 / 66 / 17, 0.02 -> 41 / 62
    # / 15 (49 cells up, 30 down), 0.04 -> 37 / 67 / 14; applied under drift too, fast-drift cells lost up to 0.02,
    # so drifting re-plans keep the best weight
    alpha_tie: float = 0.02
    home_slack: float = 0.0  # home node only when no heavier than the lightest; 0.02-0.05 lost 0.3-1 point
    fresh_swaps: int = 32  # swaps after a fresh plan (a layer stops early once a swap gains < min_gain)
    replan_swap_share: float = 0.05  # slots a kept layer's swaps may move (2 per swap): 7 swaps on 288 slots
    min_gain: float = 0.002  # of the mean GPU load: smaller gains are noise in the next window
    keep_tolerance: float = 0.06  # re-place a layer only for a >6% lower forecast max GPU load
    churn_budget: float = 0.08  # share of all L*P slots one re-plan may move (goal: <= 10%)
    spread_by_affinity: bool = True  # N > 1: group homes + co-activation replicas (affinity.py)
    # leveling swaps after a fresh plan (layers stop at level_min_gain); held out on 64/8/320 at s = 0.6: 0 swaps
    # 0.776, 32 0.789, 150 0.794 (8 nodes, 0.8 s of a 1.7 s plan at 150)
    level_swaps: int = 48
    level_min_gain: float = 1e-4  # of the squared mean GPU load; 1e-3 lost 0.002-0.004 held out
    # selections a GPU serves in a layer's forecast window up to which the leveling stops at its min gain
    # (level_min_gain, replan_level_min_gain); above it the gain shrinks as count / m, a GPU load's squared relative
    # sampling noise (leveling.noise_gain). 2,048: the held-out matrix's largest count where the leveling runs (4,096
    # tokens x 8 picks on 16 GPUs), so its cells keep the tuned gain
    level_gain_count: float = 2048.0
    # a re-plan's leveling swaps: the fresh plan's gain floor, kept where they lower a layer's hottest GPU by more
    # than replan_min_drop. Held out (32/4/288, s = 0.3): floor 1e-3 and a 3% drop 0.841, floor 1e-4 and any drop
    # 0.857 (global on 8 windows 0.859), at 4.0% -> 7.3% of slots moved per re-plan
    replan_level_min_gain: float = 1e-4
    replan_min_drop: float = 0.0
    level_cold: float = 0.5  # lone replicas below this x the mean slot load may leave their group's nodes
    seeded_churn_budget: float = 0.095  # spread layout: reseated counts + leveling swaps (goal: <= 10%)
    # where a node's slots hold every expert (P / N >= E), every node takes the same one-node plan (node_copies.py):
    # nodes per token 1.0 and node-limited dispatch the even split in expectation. bench/eplb_matrix.py's 16 / 2 / 64
    # cells (the sample model, E = 32), pooled over trace seeds 0-2 against the better global: sample-mix slow drift
    # -0.0035 -> +0.0006 even split, -0.023 -> -0.001 node-limited; fast -0.0004 -> +0.008, -0.009 -> -0.001; the
    # sample's traces +0.0003 -> +0.065, -0.012 -> +0.054; nodes per token 1.36-1.61 -> 1.00-1.05 (global's 1.75-1.82)
    node_copies: bool = True
    # ... a layer with an expert of the newest window whose replicas (N x its one-node count) would each carry more than
    # copies_hot x a GPU's mean load takes the spread layout instead (that replica would set the max GPU; with one
    # replica a node and top-K of K >= GPUs a node, never). On the sample-mix fast-drift cells above (K = 4, 8 GPUs a
    # node) one layer's hottest expert reached 1.6x that in the later windows: at inf (every layer copies) seed 0
    # trailed global by 0.024 +- 0.008 under the even split (-0.004 node-limited), at 1.0 by 0.005 (-0.028 +- 0.011
    # node-limited, the switched layer's replicas uneven over the nodes a token's cover picks between at random); pooled
    # fast +0.009 / +0.025 at inf, +0.008 / -0.001 at 1.0
    copies_hot: float = 1.0
    # every first replica stays on its group's home nodes and swaps stay inside nodes: a token's cover is never
    # larger than its groups' home nodes, as under DeepSeek's hierarchical layout; extra replicas only add choices
    keep_groups: bool = False
    # keep_groups with tokens: groups share nodes by the even split whose tokens reach the fewest nodes, its heaviest
    # node within this share of DeepSeek's balanced packing's (group_pairing.py)
    group_pair_slack: float = 0.0
    # polish moves per layer after a fresh plan, on layers of <= 128 slots and <= 8 nodes only (polish.py): the
    # exact MILP's small instances 1.6-2.8% -> 0-0.9% above its proven optimum, in sample (polish.py has the figures)
    polish_steps: int = 64
    # a re-plan of a drifting workload (the plain mean's backtest error over the best EMA weight's > 1 + refresh_drift,
    # forecast.drifts) re-places every layer a fresh plan lowers, when it lowers the forecast max GPU load by more
    # than refresh_gain on average over layers (replan.refreshed). Fast drift on bench/eplb_matrix.py's cells gave
    # 1.04-1.21 per layer at 8 nodes, slow drift 0.97-1.05; an unchanged workload never calls drift, so its
    # re-plans keep the churn budgets
    refresh_drift: float = 0.1
    # ... and, without routes and over >= 4 scored windows (drift_call.MIN_T_FOLDS), only where the plain mean's excess
    # error a scored window is at least drift_t standard errors above 0 (forecast.excess_t, DriftCall.called: counts
    # cannot be de-mixed, and a mix drawn afresh each window looks like drift on a few windows). Over
    # bench/eplb_matrix.py's SGLang-dump cells, trace seeds 0-2: slow drift on 4-18 nodes +0.0049 a cell (24 cells,
    # -0.0001 .. +0.018; against the better global +0.010 -> +0.015), slots moved a re-plan 19% -> 9.6% on average (the
    # worst cell 54% -> 18%); fast drift and one node within +-0.0002 (two nodes hold their calls). On every scored
    # window count: slow +0.0041 but fast -0.0004 (first re-plans). With routes: the sample model's 16 / 2 / 64 -0.079
    # and sample-mix fast -0.010 .. -0.025 though grouped slow +0.0036, so there the ratio decides. <= 0: off
    drift_t: float = 2.0
    refresh_gain: float = 0.02
    # a re-plan with one scored window (three windows seen) calls drift where the plain mean's error on the newest
    # window is more than early_drift x what the newest tokens' own sampling noise gives it, and plans on the newest
    # window (early_drift.py: 1.4-4.4 slow drift, 15-46 fast over bench/eplb_early_drift.py's traces). Over
    # bench/eplb_matrix.py's 104 fast-drift and sample cells with routes, trace seeds 0-2: +0.0011 a cell, the first
    # held-out window +0.011, the sample's 8 / 2 / 40 "no" a tie; needs the routes and a token-mix fit; <= 0: off
    early_drift: float = 8.0
    # two nodes with spare slots and no routes (an SGLang dump, a server plugin's counts): a re-plan the backtest calls
    # drifting is held to a still re-plan (its forecast and churn-budgeted seeded layout), whose static-even ladder
    # then climbs unbudgeted (drift_call.py has the figures); False: it re-plans as a drifting one
    hold_two_node_drift: bool = True
    # a drifting re-plan on one node, or with > 8 slots a GPU on several (planner.BOUND_SLOTS_PER_GPU), also re-places
    # each layer whose next-window E[max] bound (emax.layout_bound, the even split under the windows' variance model) a
    # fresh layout lowers by more than drift_bound_gain of it (one node: planner._plan; several: replan.held_refresh,
    # global's layout a candidate too).
    # There the forecast's max load sits at its floor in every layout (36 slots a GPU on one node: kept / fresh
    # 1.001-1.004), so stale replica counts stayed: one node, fast drift, the family cells of trace seed 0 trailed
    # global on the newest window by 0.005-0.017 at 4.6% of slots a re-plan; with this rule -0.001 .. +0.003 at
    # 24-37%. At 0 the one-node slow-drift cells of seed 1 (drift called on noise) moved 52-66% of slots a re-plan
    # instead of 3-6%; -1: off
    drift_bound_gain: float = 0.002
    # a drifting re-plan seeds the layers whose max-load floor exceeds (1 + refresh_floor) x their mean GPU load (below
    # 1.5x every such layer lost to the fresh plan on the fast-drift cells, by >= 1.6%) and 1 / refresh_probe of the
    # others; where those probes say the rest refresh, the rest take the fresh plan unseeded (replan.py); -1: seed all
    refresh_floor: float = 0.25
    refresh_probe: int = 16
    # without spare slots and with > 2 slots a GPU, the light experts of layers whose hottest expert alone is over
    # (1 + refresh_floor) x the mean GPU load take the EMA weight whose backtest picked the hot GPUs' lightest
    # partners best (partners.py: the grouped s = 1.2 cells' three "no"s on 2-8 nodes became ties); only where
    # ema_alpha is None (the weight left to the backtest)
    partner_backtest: bool = True
    # every slot one expert, two slots a GPU: the hot_partners hottest experts above the mean GPU load take the coldest
    # experts as their GPU's partner, hottest with coldest, after every plan (partners.coldest_partners: the three
    # "no"s of 128 GPUs / 16 nodes / 256 slots on trace seed 0 became a yes and two ties; one: no change there, 32:
    # the same at +8-11 points of churn); 0: off
    hot_partners: int = 3
    # ... the cold ones ranked by the EMA weight whose backtest picked each such layer's partner_light lightest experts
    # best (partners.cold_forecast: 128 / 16 / 256's 22 cells pooled over trace seeds 0-2 8 / 13 / 1 -> 14 / 8 / 0
    # against the plan's forecast; 3 lightest: too noisy); 0: by the plan's forecast
    partner_light: int = 16
    # a seeded re-plan's last swaps, with what its leveling left of the churn budget: each lowers one of the
    # hot_gpus hottest GPUs by more than hot_min_drop x the mean GPU load, no GPU reaching its old load; over
    # bench/eplb_matrix.py's 118 cells yes / tie / no 42 / 62 / 14 -> 48 / 59 / 11 (descent.py has the variants);
    # 0 GPUs: none
    hot_gpus: int = 8
    hot_min_drop: float = 0.01
    # a seeded re-plan's leveling swaps may move any replica across nodes (not only cold lone ones, leveling.py) in
    # the layers whose nodes per token on the newest tokens is below (1 - cross_slack) x that of DeepSeek global's
    # plan on the same forecast (replan.node_slack): they spend fewer nodes per token than the goal needs on
    # balance. Over bench/eplb_matrix.py's 118 cells yes / tie / no 48 / 59 / 11 -> 52 / 56 / 10, no new no: the 23
    # 4-node slow-drift cells +0.0023 on average (11 up, 2 down; nodes per token +0.00 .. +0.14, each still under
    # global's), 8 nodes +0.0005 slow and +0.0021 fast (64 GPUs / 8 nodes / 320 slots at s = 0.9: -0.013 -> -0.009
    # against global, still a no), slow-drift re-plans moving at most 9.4% of slots. With 2 slots per GPU too,
    # 0.05 made a new no (P = E, 16 nodes: 4.76 nodes per token against global's 4.75); 0.2: 51 / 56 / 11. Only on
    # <= 8 nodes with > 2 slots per GPU (replan.crosses); < 0: never. A re-plan at [58, 256] with 2,048 tokens took
    # 0.035 / 0.048 s instead of 0.025 / 0.030 s (32 GPUs / 4 nodes / 288 slots, 64 / 8 / 320; medians of 7)
    cross_slack: float = 0.1
    # a seeded re-plan's leveling lowers the forecast's squared GPU loads plus each GPU's variance over the newest
    # spread_windows windows (scenarios.spread: their deviations' axes above sampling noise), so it also parts experts
    # that rise and fall together; with > 2 slots per GPU only; 0: the forecast's squares alone. Over
    # bench/eplb_matrix.py's 118 cells yes / tie / no 52 / 56 / 10 -> 70 / 41 / 7, no new no: 88 cells of > 2 slots a
    # GPU +0.008 on average (the grouped router's 48 +0.010, the independent router's 14 -0.0005: its windows differ
    # by noise alone, so it mostly gets no spread), one yes to tie (-0.002, independent router, fast drift, 64 GPUs /
    # 8 nodes / 320 slots); slow-drift re-plans move at most 9.4% of slots. With 2 slots a GPU (pairing.py re-picks
    # after the leveling) its 30 cells moved -0.009 .. +0.004, mean +0.0001. A re-plan at [58, 320] on 8 nodes took
    # 0.051 s instead of 0.049 (--plan-time, 3 windows: one axis kept)
    spread_windows: int = 8
    # a seeded re-plan's hot swaps in layers whose hottest replicas alone set the max load (replan.floor_bound, > 2
    # slots a GPU) take drops > floor_hot_drop x the mean GPU load (0: any), not hot_min_drop (descent.py has why and
    # figures)
    floor_hot_drop: float = 0.0
    # a drifting re-plan's floor-bound layers of two slots a GPU that stay seeded at the max-load floor take the sorted
    # pairs of all their replicas (replan.resorted, pairing.sorted_pairs) where nodes per token on the newest tokens
    # stays emax_node_slack under DeepSeek global's: reseating leaves GPUs with two of the G heaviest replicas (up to
    # 29 of 144), the GPUs after the hottest 1-2 tokens over global's sorted pairs. bench/eplb_matrix.py's 144 GPUs /
    # 18 nodes / 288 slots, independent router, s = 1.2, fast drift: -0.0009 -> -0.0002 against global on the newest
    # window (no -> tie); 10 cells of 16-18 nodes -0.0000 .. +0.0012 at +0.000 .. +0.018 nodes per token, churn 2-17
    # points more in cells moving 48-74% a re-plan (drift called); without the node rule two one-group P = E cells
    # went over global's nodes per token (+0.006, +0.010). False: the seeded layers as they are
    resort_pairs: bool = True
    # P = E: up to contest_swaps swaps lowering ours' hottest GPU (any drop) before global's layouts compete, so ours
    # ties global's max load and wins layers on nodes per token (descent.py has why and figures); 0: none
    contest_swaps: int = 32
    # a still re-plan with two slots per GPU and a spare slot spends its budget after reseating on swaps of GPUs'
    # lighter replicas that lower a bound on the next window's expected max GPU load, instead of leveling, pairing
    # and hot swaps (False: those). Over bench/eplb_matrix.py's 118 cells yes / tie / no 71 / 43 / 4 -> 75 / 43 / 0,
    # the 4 no's (144 GPUs / 18 nodes / 288 slots, slow drift) three ties and a yes (emax.py has why and figures)
    emax_swaps: bool = True
    # a drifting re-plan with two slots per GPU and a spare slot: its layers that take the fresh layout get up to
    # drift_emax_swaps E[max] swaps before alignment (emax.py; not churn-budgeted there, so this bounds time only),
    # its seeded layers the still re-plan's (with emax_swaps). The fresh layout's pairing sets each GPU at or under
    # global's max load on the forecast but crowds GPUs just under it. bench/eplb_matrix.py's 22 cells of 144 GPUs /
    # 18 nodes / 288 slots, trace seeds 0-2 pooled: yes / tie / no 15 / 6 / 1 -> 16 / 6 / 0, mean +0.00027 (the fresh
    # layers' swaps alone +0.00014), nodes per token +0.02 at most (global's 1.2-1.5 more), the drifting re-plan at
    # [58, 288] 0.21 -> 0.38 s (emax.py has the variants); 0: none on fresh layers
    drift_emax_swaps: int = 72
    # a still re-plan whose budgeted plan's forecast max GPU load is, averaged over layers, more than stale_gain above
    # a fresh plan's takes the fresh plan (aligned to the previous placement): the previous placement was made for
    # another workload (a `--previous` file, a traffic switch), which the backtest cannot tell with < 2 scored windows.
    # Kept by the budget, one whose hot experts turned cold held 4.3x the mean GPU load where the fresh plan has 1.11x
    # (2.7x on one node; tests/analysis/test_eplb_stale.py). Noise alone: 1.01-1.29 (32 experts, 30% noise a window,
    # a previous plan on 2 windows), the sample model's first re-plans (1,221 tokens a window) 1.04-1.35, so 0.5:
    # none of bench/eplb_matrix.py's 118 cells trips it (0.2 would have taken two sample cells' fresh plans, +0.012
    # and +0.022 held out, and trips on noise). In the multi-node layout the fresh plan is built only where the seeded
    # plan is stale_gain above the max-load floor of the fresh counts (replan.max_load_floor <= the fresh plan's max
    # load, so no switch is missed): the synthetic cells' still re-plans sat at 1.00-1.16 x that floor. < 0: never
    stale_gain: float = 0.5
    # P = E, two slots per GPU: a still re-plan's budget left after reseating, leveling, pairing and hot swaps goes to
    # E[max] swaps, each lowering the bound by more than emax_step_drop mean GPU loads; a lighter replica changes node
    # there only in layers whose nodes per token on the newest tokens is more than emax_node_slack under DeepSeek
    # global's plan on the same forecast, and only lone ones below level_cold x the mean slot load. On the 8 cells of
    # 128 GPUs / 16 nodes / 256 slots (bench/eplb_matrix.py) yes / tie / no 4 / 3 / 1 -> 4 / 4 / 0, the grouped router's
    # +0.0000 .. +0.0005 and nothing lower, mean churn 1.1-6.8% -> 1.2-6.8% (emax.py has the variants)
    emax_node_slack: float = 0.05
    emax_step_drop: float = 1e-4
    # P = E: a re-plan's layer that lowers the forecast max GPU load by <= min_gain of it and spreads the newest tokens
    # over more nodes than the previous layer goes back to the previous layer unless its nodes per token stays
    # locality_slack under DeepSeek global's (locality.locality_kept): the seeded swaps' node moves had added up over
    # still re-plans (128 GPUs / 16 nodes, independent router, s = 1.2: 4.44 -> 4.98 nodes per token, global 4.72;
    # with this 4.53). At 0.05 it also held back layers 1-5% under global's and three P = E cells lost -0.00001 ..
    # -0.0001 of balancedness (two ties became "no"s); float("-inf"): off
    locality_slack: float = 0.0
    # P = E, a drifting re-plan: a layer takes the fresh layout where that holds its max GPU load (within
    # candidates.MAX_LOAD_TIE) with fewer nodes per token by more than locality_gain of the layer's
    # (locality.locality_refresh); < 0: off
    locality_gain: float = 0.01
    # two nodes, spare slots, tokens: a fresh plan's layer takes DeepSeek global's layout where node-limited replay of
    # the newest tokens gives it a max GPU load lower by more than replay_margin of ours', a still re-plan's layer whose
    # replayed max load is more than replay_margin above the previous placement's keeps the previous layer, and a
    # drifting re-plan's layers take global's layout as a fresh plan's do, within global's nodes per token
    # (dispatch_contest.py has the why and the figures); < 0: none of them
    replay_margin: float = 0.02
    # the plan's last step on several nodes: experts' replicas all on one node or at most one a node
    # (static_spread.py), so SGLang's static dispatch, whose node rule sends a node's ranks to its first replica,
    # splits their load evenly; per layer the hottest first, as many as keep nodes per token under DeepSeek global's
    # on the newest tokens (static_ladder.py). Held out under that dispatcher (bench/eplb_matrix.py's ours-static
    # rows) it leads the better global policy by 0.054 on average on 2-4 nodes at 0.11 fewer nodes per token (median),
    # where ours' default plan trails it by up to 0.054 and fixing every expert costs up to +0.27 nodes per token
    # over global's. `--dispatch static` (evaluate.planner_config)
    static_even: bool = False
    # which SGLang dispatch static_even plans for (static.dispatched_load's expected loads): static (the ranks left
    # without a near replica spread as whole ranks) or dynamic (each of their pairs drawn uniformly)
    sglang_dispatch: Literal["static", "dynamic"] = "static"
    # the router, where no token reaches the planner (an SGLang dump, the server plugins' load statistics): P = E,
    # global's layouts compete per layer on expected nodes per token from loads (node_model.py), a group-limited
    # router of router_top_k experts from router_topk_group groups (0: half the cluster's groups). DeepSeek V3's 8
    # and 4 of 8; topk_group 2 or 8 picked layouts up to 0.7 nodes per token worse there
    router_top_k: int = 8
    router_topk_group: int = 0
    # P = E, no tokens, fresh layouts (fresh plans, a drifting re-plan's): after the candidates' contest, swaps of
    # experts between nodes that lower the expected nodes per token (node_swaps.py), every GPU's forecast load within
    # node_swap_cap x the layer's max (the max GPU untouched). bench/eplb_matrix.py's SGLang-dump cells of 128 GPUs /
    # 16 nodes / 256 slots, global's layout swapped each window: held-out balancedness the same at 0.3 on slow and
    # fast drift (s = 0.6 and 1.2; nodes per token 6.28 -> 5.87, 4.77 -> 4.26 slow, 6.05 -> 5.56, 4.85 -> 4.29 fast);
    # at 0.4-0.6 fast drift lost 0.0002-0.003 of it, and inside the planner 0.4 lost 0.00005 +- 0.00001 on one trace
    # seed (s = 1.2, slow); 0: off
    node_swap_cap: float = 0.3
    # ... and a still re-plan without tokens (P = E): one round of those swaps, each saving more than
    # replan_swap_gain expected nodes per token (at most N / 2 swaps a layer): the seeded re-plans' moves had carried
    # hot experts off the swapped nodes (SGLang-dump 128 / 16 / 256, s = 1.2, slow drift: 4.24-4.28 nodes per token
    # in the first held-out windows, 4.57-4.61 in the last); with it the cells' means 4.50 / 4.42 / 4.58 -> 4.30 /
    # 4.36 / 4.46 on trace seeds 0-2 at 0.1-0.6 points more churn. A drifting re-plan's seeded layers take the
    # same round before locality.locality_refresh compares them with the fresh layouts (which had been taken for
    # being another layout of the swaps: the s = 1.2 cells' churn 11-32% a re-plan -> 11-21%); <= 0: none
    replan_swap_gain: float = 0.005

    @property
    def router(self) -> tuple[int, int]:
        """(router_top_k, router_topk_group): node_model.expected_nodes' and node_swaps' router."""
        return self.router_top_k, self.router_topk_group

    def __post_init__(self) -> None:
        bad_alpha = self.ema_alpha is not None and not 0 <= self.ema_alpha <= 1
        if bad_alpha or min(self.keep_tolerance, self.home_slack, self.min_gain, self.alpha_tie) < 0:
            raise PlacementError(f"ema_alpha={self.ema_alpha} must be in [0, 1] (0: mean); tolerances must be >= 0")
        if self.hot_partners < 0:
            raise PlacementError(f"hot_partners={self.hot_partners} must be >= 0 (0: off)")
        if not 0 <= self.node_swap_cap < 1:
            raise PlacementError(f"node_swap_cap={self.node_swap_cap} must be in [0, 1) (a share of the max GPU load)")
        if self.router_top_k < 1 or self.router_topk_group < 0:
            raise PlacementError(f"router_top_k={self.router_top_k} must be >= 1 and router_topk_group="
                                 f"{self.router_topk_group} >= 0")
