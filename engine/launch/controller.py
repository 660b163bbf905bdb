"""DpController: the front end's choice of DP rank for each request (SGLang's DataParallelController).

Pure bookkeeping, no processes: `assign` on submission, `finished` when the request's last result comes back.

- round_robin: ranks in turn, 0, 1, ..., dp_size - 1, 0, ...; a pinned request does not take a turn.
- shortest_queue: the rank with the fewest requests in flight (assigned and not yet finished), the lowest
  rank on a tie. The front end counts them itself, so the choice needs no message from the ranks.
- routed_dp_rank (SGLang's field): pins the request to that rank under either method.
"""

from __future__ import annotations

from typing import Any

from r3trace.engine.launch.config import LOAD_BALANCE_METHODS, LoadBalanceMethod
from r3trace.engine.request import InvalidRequestError


def check_routed_dp_rank(value: Any, dp_size: int) -> int | None:
    """None (free) or a DP rank in 0..dp_size-1; anything else is an error naming the field."""
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < dp_size:
        raise InvalidRequestError("routed_dp_rank", f"{value!r} outside 0..{dp_size - 1} (dp_size={dp_size})")
    return value


class DpController:
    def __init__(self, dp_size: int, method: LoadBalanceMethod = "round_robin") -> None:
        if method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load_balance_method={method!r} must be one of {list(LOAD_BALANCE_METHODS)}")
        self.dp_size = dp_size
        self.method = method
        self.in_flight = [0] * dp_size  # requests assigned to each rank and not finished yet
        self._next = 0  # round robin's next rank

    def assign(self, routed_dp_rank: int | None = None) -> int:
        """The DP rank of a new request (routed_dp_rank checked by check_routed_dp_rank first)."""
        if routed_dp_rank is not None:
            rank = check_routed_dp_rank(routed_dp_rank, self.dp_size)
            assert rank is not None
        elif self.method == "round_robin":
            rank, self._next = self._next, (self._next + 1) % self.dp_size
        else:
            rank = min(range(self.dp_size), key=lambda r: (self.in_flight[r], r))
        self.in_flight[rank] += 1
        return rank

    def finished(self, dp_rank: int) -> None:
        self.in_flight[dp_rank] -= 1
