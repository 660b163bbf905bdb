"""How many thread-block clusters of the Gluon MLA decode kernels fit on this GPU at once (cluster_merge.py).

Run (GPU, sm_90): python bench/cluster_occupancy.py  -> one line per (kernel, cluster size), JSON in
$OUT/cluster_occupancy.json

Why: a cluster's CTAs must be resident together on one GPC. At one CTA an SM (the narrow kernel's 165 KB of shared
memory, the wide one's 224 KB) the clusters that fit at once are fewer than SMs / P where GPCs have SM counts that P
does not divide; when a launch has more clusters than that, the rest wait for a second wave (session 8 run 1: 16
clusters of 8 at B16/1k took 1.7x the merge kernel's time). Each kernel is compiled by one mla_decode call at each
cluster size, then asked through the driver's cuOccupancyMaxActiveClusters (triton's utils; it assumes 128 threads a
block, the narrow kernel's: the wide kernel's 256 do not bind here, its shared memory does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from triton.runtime.driver import driver

from r3trace.kernels.mla_decode import DecodeTile, mla_decode
from r3trace.kernels.mla_decode import narrow as mla_decode_narrow
from r3trace.kernels.mla_decode import wide as mla_decode_gluon
from r3trace.kernels.mla_decode.tile import CLUSTER_SIZES

TILES = {
    "narrow": (DecodeTile(16, 64, 4, 2, kernel="narrow", page_size=64, cluster=8), 16,
               mla_decode_narrow._mla_decode_narrow_kernel),
    "wide": (DecodeTile(64, 64, 8, 2, kernel="wide", page_size=64, cluster=8), 128,
             mla_decode_gluon._mla_decode_gluon_kernel),
}  # fmt: skip


def main() -> None:
    out: dict[str, object] = {"device": torch.cuda.get_device_name(),
                              "sms": torch.cuda.get_device_properties(0).multi_processor_count}  # fmt: skip
    for name, (tile, heads, kernel) in TILES.items():
        lens = torch.full((4,), 2048, device="cuda")
        r2t = torch.arange(4 * 2048, device="cuda", dtype=torch.int32).view(4, 2048)
        q = torch.randn(4, heads, 576, device="cuda").bfloat16()
        kv = torch.randn(4 * 2048, 576, device="cuda").bfloat16()
        for p in CLUSTER_SIZES:
            mla_decode(q, kv, r2t, torch.arange(4, device="cuda"), lens, 512, 0.05, p, tile)
        torch.cuda.synchronize()
        for compiled in kernel.device_caches[torch.cuda.current_device()][0].values():
            cluster = dict(compiled.src.constants).get((compiled.src.fn.arg_names.index("CLUSTER"),), 1)
            if cluster in CLUSTER_SIZES:
                shared = compiled.packed_metadata[2]
                fit = driver.active.utils.cuOccupancyMaxActiveClusters(compiled.function, shared, cluster)
                out[f"{name} x{cluster}"] = {"shared": shared, "max_active_clusters": fit, "ctas": fit * cluster}
                print(f"{name} cluster {cluster}: {shared} B shared, {fit} clusters at once ({fit * cluster} CTAs)",
                      flush=True)  # fmt: skip
    out_dir = Path(os.environ.get("OUT", "out"))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cluster_occupancy.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
