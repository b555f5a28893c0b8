"""Probe for issue 19: is the H128 decode kernel's score GEMM bound by shared-memory reads?

The Gluon kernel (`kernels/mla_attention_gluon.py`) computes each 64-key tile's scores
S = Q K^T (64 query rows, 576 deep) with both warpgroups, each a `m64n32` wgmma over half
the keys. Every wgmma reads its A operand (Q) from shared memory, so each warpgroup reads all
of Q once per tile: per k16 step a warpgroup reads 2 KB of Q and 1 KB of K for 64 x 32 x 16
MACs. At the H100's 128 B/clock of shared memory and ~1024 dense bf16 MACs/clock/SM that is
24 clocks of reads for 16 of maths (1.5x). FlashMLA gives each warpgroup whole tiles
(`m64n64`: 4 KB for 64 x 64 x 16 MACs, 32 clocks each, balanced), which needs warp
specialisation (the two warpgroups on different tiles).

Measured here, per SM, with Q and one K tile resident in shared memory and no softmax, TMA
or P @ V: (a) two warpgroups, `m64n32` each over the same tile (the kernel's split); (b) one
warpgroup, `m64n64` over the whole tile (FlashMLA's per-warpgroup shape, half the warps);
(c) two warpgroups, each `m64n64` over the whole tile (the same tile twice: twice the
maths, what two warpgroups on two tiles would read). If (b) matches (a) per tile and (c) runs
at (b)'s rate per GEMM, the split costs the kernel its score throughput and warp
specialisation is the fix; if (a) is already at the tensor peak, it is not.

    python3 scripts/probe_score_gemm.py            # H100: a few seconds; JSON on stdout
"""

from __future__ import annotations

import json

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

from mla_backends.bench.timing import bench_us
from mla_backends.kernels.gluon_tiles import _barrier  # gl.thread_barrier / gl.barrier

L, R = gl.constexpr(512), gl.constexpr(64)  # latent and rope widths


@gluon.jit
def _score_loop(
    Q,
    K,
    Out,
    ITERS: gl.constexpr,
    M: gl.constexpr,
    WG_N: gl.constexpr,
    WARPS_M: gl.constexpr,
    WARPS_N: gl.constexpr,
):
    """ITERS score tiles S = Q K^T (Q [M, 576], K [64, 576], both in shared memory), each
    warpgroup a `m64n{WG_N}` wgmma; the accumulator's sum is stored so nothing is dropped."""
    LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS_M * WARPS_N, 1], [1, 0])
    S_L: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N], instr_shape=[16, WG_N, 16]
    )
    qrows = gl.arange(0, M, layout=gl.SliceLayout(1, LD))
    krows = gl.arange(0, 64, layout=gl.SliceLayout(1, LD))
    cl = gl.arange(0, L, layout=gl.SliceLayout(0, LD))
    cr = gl.arange(0, R, layout=gl.SliceLayout(0, LD))
    dt: gl.constexpr = Q.dtype.element_ty
    ql: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, L], dt)
    qrl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([M, R], dt)
    kl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, L], dt)
    krl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, R], dt)
    q = gl.allocate_shared_memory(dt, [M, L], ql, gl.load(Q + qrows[:, None] * 576 + cl[None, :]))
    qr = gl.allocate_shared_memory(
        dt, [M, R], qrl, gl.load(Q + qrows[:, None] * 576 + L + cr[None, :])
    )
    k = gl.allocate_shared_memory(dt, [64, L], kl, gl.load(K + krows[:, None] * 576 + cl[None, :]))
    kr = gl.allocate_shared_memory(
        dt, [64, R], krl, gl.load(K + krows[:, None] * 576 + L + cr[None, :])
    )
    fence_async_shared()
    _barrier()
    s = gl.zeros([M, 64], gl.float32, S_L)
    for _ in range(ITERS):
        s = warpgroup_mma(q, k.permute((1, 0)), s)
        s = warpgroup_mma(qr, kr.permute((1, 0)), s)
    gl.store(Out + gl.program_id(0), gl.sum(gl.sum(s, 1), 0))


# name: (query rows M, wgmma N per warpgroup, warps along M, warps along N); 4 warps a
# warpgroup: (a) 8 warps, both warpgroups on the same 64 rows, half the keys each (the
# kernel); (b) 4 warps, one warpgroup, all 64 keys; (c) 8 warps, each warpgroup its own 64
# rows and all 64 keys (FlashMLA's per-warpgroup shape on the whole SM)
VARIANTS = {
    "a_two_wg_m64n32_split": (64, 32, 4, 2),
    "b_one_wg_m64n64": (64, 64, 4, 1),
    "c_two_wg_m64n64_own_rows": (128, 64, 8, 1),
}


def main() -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    q = torch.randn(128, 576, device=dev).bfloat16()
    kk = torch.randn(64, 576, device=dev).bfloat16()
    out = torch.empty(sms, device=dev)
    iters = 256
    res: dict[str, dict[str, float]] = {}
    for name, (m, wg_n, wm, wn) in VARIANTS.items():

        def run(m: int = m, n: int = wg_n, wm: int = wm, wn: int = wn) -> None:
            _score_loop[(sms,)](
                q, kk, out, ITERS=iters, M=m, WG_N=n, WARPS_M=wm, WARPS_N=wn, num_warps=wm * wn
            )

        us = bench_us(run, device=dev)
        flop = 2.0 * m * 64 * 576 * iters * sms
        res[name] = {
            "us": us,
            "tflops": flop / (us * 1e-6) / 1e12,
            "clocks_per_64x64_tile": us * 1e-6 * 1.755e9 / (iters * m / 64),
        }
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sms": sms}
    print(json.dumps({"meta": meta, "variants": res}, indent=1))


if __name__ == "__main__":
    main()
