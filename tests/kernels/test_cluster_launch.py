"""launch_in_clusters' host decisions (cluster_merge.py), on CPU with a stand-in for the compiled kernel: the
cluster sizes it takes, a triton whose packed launch metadata is not the (num_warps, num_ctas, shared) it was written
for (warns, launches nothing, so mla_decode runs the merge kernel), and an exchange larger than the kernel's shared
memory (a programming error: raises). The launches themselves are GPU tests (test_cluster_merge.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.kernels.conftest import requires_triton

pytestmark = [requires_triton]


class _Kernel:
    """What launch_in_clusters asks of a JIT function before launching: run(..., warmup=True) -> compiled kernel."""

    arg_names = ["x", "N"]

    def __init__(self, packed: Any) -> None:
        self.packed = packed

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> SimpleNamespace:
        assert warmup, "must only compile (warmup), never launch through the JIT path"
        return SimpleNamespace(packed_metadata=self.packed)


def test_cluster_sizes() -> None:
    from r3trace.kernels.mla_decode.cluster_merge import launch_in_clusters

    with pytest.raises(ValueError, match="cluster 3 not in"):
        launch_in_clusters(_Kernel((4, 1, 1024)), (1, 1, 1), 3, (None,), {"N": 1}, 64)


def test_another_tritons_metadata_warns_and_declines() -> None:
    from r3trace.kernels.mla_decode.cluster_merge import launch_in_clusters

    for packed in ((4, 1, 1024, 0), (4, 2, 1024), [4, 1, 1024]):
        with pytest.warns(RuntimeWarning, match="merging the splits in a second kernel"):
            assert launch_in_clusters(_Kernel(packed), (1, 1, 1), 2, (None,), {"N": 1}, 64) is False


def test_exchange_must_fit_the_kernels_shared_memory() -> None:
    from r3trace.kernels.mla_decode.cluster_merge import launch_in_clusters

    with pytest.raises(RuntimeError, match="exchange exceeds the kernel's 1024 B"):
        launch_in_clusters(_Kernel((4, 1, 1024)), (1, 1, 1), 2, (None,), {"N": 1}, 2048)
