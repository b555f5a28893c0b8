"""The `triton` backend: our own kernels (mla_backends/kernels), every mode, page sizes 1-128,
FP8 KV dequantized in registers. Runs on any CUDA GPU with Triton, and on CPU under
TRITON_INTERPRET=1 (tests only)."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

from mla_backends.backends.base import BackendContext, Capability, MLABackend
from mla_backends.backends.registry import register_backend
from mla_backends.batch import ForwardBatch, RaggedLayout
from mla_backends.config import Config
from mla_backends.indices import build_page_table, cumsum_indptr, page_table_width

logger = logging.getLogger(__name__)


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


@dataclass
class TritonMetadata:
    qo_indptr: torch.Tensor  # [B + 1] int32, device
    table: torch.Tensor  # [B, W] int32, device: page ids, tail = dummy page 0 (never read)
    max_q_len: int  # host
    num_splits: int  # host
    workspace: tuple[torch.Tensor, torch.Tensor] | None  # split partials (out, lse), device


def block_m_for(rows: int, dot_dtype: torch.dtype, gluon: bool) -> int:
    """Query rows (token, head) per program of the absorbed kernel, for `rows` per request."""
    if rows <= 16 or dot_dtype == torch.float32:
        # fp32 dots are FMA loops, not tensor-core MMAs: 32- and 64-row blocks spilled 8-16 KB
        # a thread on SM90 (offline compile), 16 rows none.
        return 16
    # H16 q_len 2: half a Gluon block measured 0.88x FlashMLA, the 32-row Triton
    # block 0.62x (mma.sync, 46 spills; BENCHMARKS.md, Gluon decode kernel).
    return 32 if rows <= 32 and not gluon else 64


def launch_config(
    block_m: int,
    page_size: int,
    batch_size: int,
    num_splits: int,
    dot_dtype: torch.dtype,
    gluon: bool,
    width: int,
    smem_limit: int | None,
) -> dict[str, int | bool]:
    """Tiles, warps and stages of the absorbed kernel on a GPU whose blocks may take
    `smem_limit` bytes of shared memory (None: no limit known), for rows `width` (L + R)
    wide. From the H200 probes (scripts/sweep_triton.py, scripts/probe_triton_regs.py).
    `tma` asks for TMA tiles where the page size allows them (whole tiles inside one page,
    `mla_attention.tma_ok`)."""
    cfg: dict[str, int | bool]
    if dot_dtype == torch.float32:
        # Operands are 4 bytes and the dots FMA loops: 64-key tiles beside a 64-row query
        # needed 442 KB with TMA (the H100 allows 227 KB). 16 x 16 tiles: 75 KB, no spills.
        cfg = {"block_n": 16, "num_warps": 4, "num_stages": 2, "tma": False}
    elif block_m >= 64:
        # The Gluon kernel where it can run (SM90, bf16 / fp16, page % 64 == 0); else
        # TMA stages beside the [64, 576] query: two 64-key stages fit in 227 KB, three
        # do not. TMA: 0.46x FlashMLA at H128 B64, gather 0.42x.
        if page_size % 64 == 0:
            cfg = {"block_n": 64, "num_warps": 8, "num_stages": 2, "tma": True, "gluon": gluon}
        else:
            cfg = {"block_n": 64, "num_warps": 8, "num_stages": 3, "tma": False}
    elif block_m == 32:  # TMA spilled here (64-186 spills): gather 0.62x, TMA 0.45-0.52x
        cfg = {"block_n": 64, "num_warps": 4, "num_stages": 2, "tma": False}
    elif page_size % 32 == 0 and batch_size >= 32 and num_splits <= 2:
        # H16 B256 kv1024 (1 split): TMA 32-key tiles 0.90-0.92x FlashMLA, gather 0.84x;
        # B128 kv8192 (2 splits): 0.85x both. At 4+ splits (B64 and below) TMA measured
        # 0.59-0.61x against the gather's 0.84-0.87x, and small eager batches cannot hide
        # the two tensor maps each TMA launch encodes on the host (B1: 84 us vs 27 us).
        cfg = {"block_n": 32, "num_warps": 4, "num_stages": 4, "tma": True}
    else:
        cfg = {"block_n": 64, "num_warps": 4, "num_stages": 3, "tma": False}
    return _fit_smem(cfg, block_m, width, dot_dtype.itemsize, smem_limit)


def _fit_smem(
    cfg: dict[str, int | bool], block_m: int, width: int, elem: int, limit: int | None
) -> dict[str, int | bool]:
    """Fewer TMA stages, then narrower key tiles, until the kernel's shared memory
    (`mla_attention.smem_bytes`) fits `limit`. The Gluon kernel sizes its own."""
    from mla_backends.kernels.mla_attention import smem_bytes

    bn, stages, tma = int(cfg["block_n"]), int(cfg["num_stages"]), bool(cfg["tma"])
    while limit is not None and smem_bytes(block_m, bn, stages, tma, width, elem) > limit:
        if tma and stages > 1:
            stages -= 1
        elif bn > 16:
            bn //= 2
        else:
            need = smem_bytes(block_m, bn, stages, tma, width, elem)
            raise ValueError(
                f"triton MLA kernel: {block_m} x {bn} tiles of {width}-wide rows need {need} "
                f"bytes of shared memory, this GPU allows {limit}"
            )
    return {**cfg, "block_n": bn, "num_stages": stages}


def mha_config(dot_dtype: torch.dtype) -> dict[str, int]:
    """Tiles, warps and stages of the MHA prefill kernel (`mha_prefill`) on a GPU."""
    if dot_dtype == torch.float32:
        # FMA dots: 128 x 64 tiles spilled 13.9 KB a thread on SM90, 16 x 16 none
        # (scripts/compile_triton_sm90.py float32 mha).
        return {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 2}
    return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 2}


def mha_route(
    dtype: torch.dtype, on_gpu: bool, sdpa_fits: bool, need_lse: bool, cudnn_lse: bool
) -> str:
    """Which kernel runs an MHA-mode prefill: "sdpa" (torch, no LSE), "cudnn" (torch's cuDNN
    attention with LSE) or "triton" (ours). `sdpa_fits`: torch's top-left causal rule equals
    ours (every request has as many queries as keys)."""
    if on_gpu and sdpa_fits and not need_lse:
        return "sdpa"
    # Hazard: torch's cuDNN attention op runs any dtype but bf16 as fp16 (MHA.cpp sets the
    # graph's io type HALF unless bf16; only SDPA's dispatcher checks dtypes, and we call the
    # op directly): fp32 q / k / v were read as fp16 bit patterns, NaN in out and LSE.
    if on_gpu and sdpa_fits and cudnn_lse and dtype in (torch.float16, torch.bfloat16):
        return "cudnn"
    return "triton"


def choose_num_splits(
    programs: int, max_kv_len: int, sms: int, waves: int, max_splits: int = 16
) -> int:
    """Split KV until the grid covers the GPU `waves` times (2 when bandwidth-bound, 1 when
    compute-bound), keeping >= 256 keys per split. A power of two (the merge kernel's
    arange needs one). Measured on H200 (BENCHMARKS.md, launch-config sweep)."""
    want = max(1, round(waves * sms / max(programs, 1)))
    want = min(want, max(1, max_kv_len // 256), max_splits)
    return 1 << (want.bit_length() - 1)


@register_backend("triton")
class TritonBackend(MLABackend):
    name = "triton"
    supports_graphs = True

    @classmethod
    def _supports_extra(cls, config: Config, cap: Capability, role: str) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed (pip install triton)"
        if cap.device_type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "triton on a CPU runs only under TRITON_INTERPRET=1 (tests), no GPU found"
        if cap.sm is not None and cap.sm < (8, 0):
            return f"triton MLA kernels need SM80 or newer, found {cap.describe()}"
        if cap.sm is not None and config.kv_dtype == "float8_e4m3fn" and cap.sm < (8, 9):
            return f"FP8 KV needs SM89 or newer, found {cap.describe()}"
        d = config.model
        if not (_pow2(d.kv_lora_rank) and _pow2(d.qk_rope_head_dim)):
            return (
                f"triton MLA kernels need kv_lora_rank and qk_rope_head_dim to be powers of "
                f"two >= 16, got {d.kv_lora_rank} and {d.qk_rope_head_dim}"
            )
        return None

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        from mla_backends.kernels import common, mha_prefill, mla_attention, store

        self._k_attn, self._k_mha, self._k_store = mla_attention, mha_prefill, store
        self._dot_f32 = common.interpreting()
        self._sms = common.num_sms(self.device)
        self._smem_limit = common.max_shared_mem(self.device)
        self._gluon = self._gluon_usable()
        self._cudnn_lse = hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")
        self.metadata: TritonMetadata | None = None
        self._graphs: dict[tuple[int, int], TritonMetadata] = {}

    # ------------------------------------------------------------------ tuning
    def _gluon_usable(self) -> bool:
        """Whether 64-row blocks take the Gluon kernel here (it re-checks each call)."""
        kv = self.pool.kv_buffer[0]
        lat = self.dims.kv_lora_rank
        return self._k_attn.gluon_usable(kv.dtype, kv, self.pool.page_size, lat)

    def _gluon_on(self) -> bool:
        # The first failure to build the Gluon kernel turns it off for the process.
        return self._gluon and self._k_attn.gluon_error() is None

    def _block_m(self, rows: int, dot_dtype: torch.dtype) -> int:
        return block_m_for(rows, dot_dtype, self._gluon_on())

    def _launch_cfg(
        self, block_m: int, batch_size: int, num_splits: int, dot_dtype: torch.dtype
    ) -> dict[str, int | bool]:
        if self._dot_f32:  # the interpreter wants tiny tiles
            return {"block_n": 16, "num_warps": 4, "num_stages": 1, "tma": False}
        d = self.dims
        return launch_config(
            block_m,
            self.pool.page_size,
            batch_size,
            num_splits,
            dot_dtype,
            self._gluon_on(),
            d.kv_lora_rank + d.qk_rope_head_dim,
            self._smem_limit,
        )

    def _waves(self, block_m: int) -> int:
        return 1 if block_m >= 64 else 2

    def _num_splits(self, batch_size: int, max_q: int, max_kv: int) -> int:
        """KV splits for a decode / verify grid of batch_size x head blocks."""
        rows = max_q * self.dims.num_heads
        bm = self._block_m(rows, self.ctx.config.torch_dtype)
        return choose_num_splits(batch_size * -(-rows // bm), max_kv, self._sms, self._waves(bm))

    # ------------------------------------------------------------------ metadata
    def _build(
        self,
        batch: ForwardBatch,
        max_q: int,
        max_kv: int,
        width: int,
        static: TritonMetadata | None,
    ) -> TritonMetadata:
        ps = self.pool.page_size
        qo = cumsum_indptr(batch.extend_seq_lens, None if static is None else static.qo_indptr)
        table = build_page_table(
            self.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            ps,
            width,
            0,
            None if static is None else static.table,
        )
        if static is not None:
            return TritonMetadata(qo, table, max_q, static.num_splits, static.workspace)
        splits = (
            self._num_splits(batch.batch_size, max_q, max_kv)
            if batch.mode.is_decode_or_verify
            else 1
        )
        ws = None
        if splits > 1:
            rows = batch.num_tokens * self.dims.num_heads * splits
            ws = (
                torch.empty(rows, self.dims.kv_lora_rank, dtype=torch.float32, device=self.device),
                torch.empty(rows, dtype=torch.float32, device=self.device),
            )
        return TritonMetadata(qo, table, max_q, splits, ws)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.batch_size == 0:
            self.metadata = None
            return
        max_q = int(batch.extend_seq_lens_cpu.max())
        max_kv = int(batch.seq_lens_cpu.max())
        width = page_table_width(max_kv, self.pool.page_size)
        self.metadata = self._build(batch, max_q, max_kv, width, None)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        ps, max_ctx = self.pool.page_size, self.req_to_token.shape[1]
        self._graph_width = page_table_width(max_ctx, ps)
        self._graph_max_bs, self._graph_max_tokens = max_bs, max_num_tokens
        self._graph_qo = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self._graph_table = torch.zeros(
            max_bs, self._graph_width, dtype=torch.int32, device=self.device
        )
        self._graph_splits = 16
        rows = max_num_tokens * self.dims.num_heads * self._graph_splits
        self._graph_ws = (
            torch.empty(rows, self.dims.kv_lora_rank, dtype=torch.float32, device=self.device),
            torch.empty(rows, dtype=torch.float32, device=self.device),
        )

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        bs, max_q = batch.batch_size, max(batch.num_draft_tokens, 1)
        h = self.dims.num_heads
        # Splits are fixed per captured size, for the longest context the graph may see.
        splits = self._num_splits(bs, max_q, self.req_to_token.shape[1])
        rows = batch.num_tokens * h * splits
        ws = (self._graph_ws[0][:rows], self._graph_ws[1][:rows]) if splits > 1 else None
        # Every captured size reads the leading rows of the same static buffers.
        static = TritonMetadata(self._graph_qo[: bs + 1], self._graph_table[:bs], max_q, splits, ws)
        self._graphs[(bs, max_q)] = static
        self.metadata = self._build(batch, max_q, 0, self._graph_width, static)

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        key = (batch.batch_size, max(batch.num_draft_tokens, 1))
        if key not in self._graphs:
            raise RuntimeError(f"no graph captured for (batch, q_len) = {key}")
        # Refill the captured buffers in place: same pointers, new contents.
        self.metadata = self._build(batch, key[1], 0, self._graph_width, self._graphs[key])

    @property
    def cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ------------------------------------------------------------------ attention
    def store_kv(
        self, layer: int, loc: torch.Tensor, k_nope: torch.Tensor, k_rope: torch.Tensor
    ) -> None:
        d = self.dims
        from mla_backends.checks import check_tensor

        t = loc.shape[0]
        check_tensor("k_nope", k_nope, (t, d.kv_lora_rank), None, self.device)
        check_tensor("k_rope", k_rope, (t, d.qk_rope_head_dim), None, self.device)
        self._k_store.store_latent_rows(
            self.pool.kv_buffer[layer],
            self.pool.scales[layer],
            loc,
            k_nope,
            k_rope,
            self.pool.is_fp8,
        )

    def _attend_absorbed(
        self,
        layer: int,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        batch: ForwardBatch,
        need_lse: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t, h, lat = q_nope.shape
        out = torch.empty_like(q_nope)
        lse = torch.empty(t, h, dtype=torch.float32, device=q_nope.device)
        md = self.metadata
        if md is None:
            if batch.batch_size == 0:
                return out, lse
            raise RuntimeError("init_forward_metadata was not called for this batch")
        block_m = self._block_m(md.max_q_len * h, q_nope.dtype)
        self._k_attn.mla_attention(
            q_nope,
            q_rope,
            self.pool.kv_buffer[layer],
            md.table,
            md.qo_indptr,
            batch.seq_lens,
            self.pool.page_size,
            self.scale,
            self.pool.scale(layer),
            md.max_q_len,
            md.num_splits,
            out,
            lse,
            md.workspace,
            block_m=block_m,
            dot_f32=self._dot_f32,
            **self._launch_cfg(block_m, batch.batch_size, md.num_splits, q_nope.dtype),
        )
        return out, lse

    def _attend_mha(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: RaggedLayout,
        causal: bool,
        need_lse: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype, device=q.device)
        route = mha_route(
            q.dtype, q.is_cuda, self._sdpa_fits(layout, causal), need_lse, self._cudnn_lse
        )
        if route == "sdpa":
            return self._torch_prefill(q, k, v, layout, causal, out, None)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if route == "cudnn":
            try:
                return self._torch_prefill(q, k, v, layout, causal, out, lse)
            except RuntimeError as e:  # this cuDNN / torch cannot: our kernel, from now on
                self._cudnn_lse = False
                logger.warning("cuDNN attention with LSE unavailable (%s); using Triton", e)
        cfg = (
            {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}
            if self._dot_f32
            else mha_config(q.dtype)
        )
        self._k_mha.mha_prefill(
            q,
            k,
            v,
            layout.qo_indptr,
            layout.kv_indptr,
            layout.max_q_len,
            self.scale,
            causal,
            out,
            lse,
            dot_f32=self._dot_f32,
            **cfg,
        )
        return out, lse

    @staticmethod
    def _sdpa_fits(layout: RaggedLayout, causal: bool) -> bool:
        # SDPA's is_causal is top-left aligned: it equals our bottom-right rule only when
        # every request has as many queries as keys.
        return not causal or torch.equal(layout.qo_indptr_cpu, layout.kv_indptr_cpu)

    def _torch_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: RaggedLayout,
        causal: bool,
        out: torch.Tensor,
        lse: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per request through torch: SDPA (cuDNN on Hopper) when no LSE is asked, else the
        same cuDNN kernel called with compute_log_sumexp (natural-log LSE, for chunk merges).
        Both measured faster than our Triton kernel at 8k tokens (BENCHMARKS.md). Requests
        with no keys give out 0 and LSE -inf, as the merge expects."""
        import torch.nn.functional as F

        cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention
        qo, kv = layout.qo_indptr_cpu.tolist(), layout.kv_indptr_cpu.tolist()
        for i in range(layout.batch_size):
            qs, qe, ks, ke = qo[i], qo[i + 1], kv[i], kv[i + 1]
            if qe == qs:
                continue
            if ke == ks:
                out[qs:qe].zero_()
                if lse is not None:
                    lse[qs:qe] = float("-inf")
                continue
            # 4-D [1, H, S, D]: 3-D inputs fall back to the math kernel (50x slower at 8k).
            qi, ki, vi = (
                x[a:e].transpose(0, 1).unsqueeze(0)
                for x, a, e in ((q, qs, qe), (k, ks, ke), (v, ks, ke))
            )
            if lse is None:
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal, scale=self.scale)
            else:
                o, lse_i = cudnn(qi, ki, vi, None, True, 0.0, causal, False, scale=self.scale)[:2]
                lse[qs:qe] = lse_i.reshape(q.shape[1], qe - qs).transpose(0, 1)
            out[qs:qe] = o[0].transpose(0, 1)
        return out, lse
