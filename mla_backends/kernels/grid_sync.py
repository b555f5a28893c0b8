"""Programs of one launch waiting for each other on a counter in global memory: the one-launch
top-k between its radix passes (`sparse/topk_fused.py`), the `tl.dot` sparse kernel before it
merges its own splits (`sparse/triton_kernel.py`).

Hazards:
- A spinning program waits for programs of its own launch, so every program must be resident
  at once: callers keep the grid within the device's SMs and each program small enough to
  fit an SM beside the others. A process given fewer SMs than the device has (MPS thread
  limits, green contexts) must not take these paths: `Config.indexer_topk: launches` for the
  top-k, MLA_SPARSE_MERGE_HERE=0 for the sparse merge.
- The Triton interpreter runs programs one after another and would spin forever: callers
  never take these paths under it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def arrive_and_wait(Counter, target):
    """Waits until `target` programs arrived at Counter: what every program wrote before its
    arrival is then visible (acquire-release on arrival, acquire while spinning)."""
    tl.debug_barrier()  # every thread of this program issued its writes
    # the arrival's own count first: the last program goes on without another round trip to
    # L2 (acquire: it then sees what the others released)
    seen = tl.atomic_add(Counter, 1, sem="acq_rel", scope="gpu") + 1
    while seen < target:
        seen = tl.atomic_add(Counter, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
