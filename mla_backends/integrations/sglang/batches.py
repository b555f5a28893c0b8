"""SGLang's ForwardBatch (or the graph runner's replay view) -> our ForwardBatch.

Contracts that differ, each converted here:
- TARGET_VERIFY: SGLang's `seq_lens` exclude the draft tokens, ours include them (KV length
  after the step), so ours = SGLang's + q_len.
- DECODE / TARGET_VERIFY batches carry no `extend_*` fields in SGLang; ours always do.
- Integer dtypes: SGLang serves int64 request rows and lengths (the kit int32); ours are int32.
- CUDA-graph replay: SGLang passes a SimpleNamespace whose `out_cache_loc` is the live,
  unpadded tensor and whose `num_padding` says how many trailing rows are padding (the kit
  and two-batch overlap's child views pass none: the live slots say it). Padded rows arrive
  with request row 0 and seq_len = our fill value; their tokens are pointed at slot 0 (the
  dummy page) here, so they never write a real slot.
No function here reads a device tensor back to the host: sizes come from tensor shapes and
the CPU copies SGLang carries (`seq_lens_cpu`, `extend_*_cpu`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mla_backends.batch import ForwardBatch, ForwardMode, RaggedLayout


class BatchError(ValueError):
    """An SGLang batch the adapter cannot serve (names the field and the mode)."""


def _mode(fb: Any) -> ForwardMode:
    m = fb.forward_mode
    if m.is_decode():
        return ForwardMode.DECODE
    if m.is_target_verify():
        return ForwardMode.TARGET_VERIFY
    if m.name in ("EXTEND", "MIXED", "SPLIT_PREFILL"):  # ragged new tokens, causal
        return ForwardMode.EXTEND
    # DRAFT_EXTEND_V2 (a draft model's attention) and DLLM_EXTEND (diffusion, not causal)
    raise BatchError(f"forward mode {m.name} is not served by mla-backends")


def _q_len(fb: Any, mode: ForwardMode) -> int:
    """Query tokens per request in DECODE (1) and TARGET_VERIFY (the draft count: the spec
    input's `draft_token_num`, else from shapes, `input_ids` holding batch_size * q_len
    tokens). Hazard: under DP attention SGLang pads a verify batch's tokens to a multiple of
    the attention-TP size, so the shape alone can name a wrong draft count."""
    if mode is ForwardMode.DECODE:
        return 1
    bs, n = int(fb.batch_size), fb.input_ids.numel()
    spec = getattr(fb, "spec_info", None)
    if getattr(spec, "ragged_verify_layout", None) is not None:
        raise BatchError(
            "TARGET_VERIFY with a ragged verify layout (per-request draft counts: "
            "SGLANG_RAGGED_VERIFY_MODE other than static) is not served by mla-backends; set "
            "SGLANG_RAGGED_VERIFY_MODE=static"
        )
    draft = getattr(spec, "draft_token_num", None)
    if isinstance(draft, int) and draft > 0:
        if n < bs * draft:
            raise BatchError(f"TARGET_VERIFY with {n} tokens for {bs} requests x {draft} drafts")
        return draft
    if bs == 0 or n % bs:
        raise BatchError(f"TARGET_VERIFY with {n} tokens over {bs} requests: not uniform")
    return n // bs


def _cpu_i32(x: Any, what: str) -> torch.Tensor:
    if x is None:
        raise BatchError(
            f"the batch carries no {what}; mla-backends sizes its metadata from SGLang's CPU "
            "copies (needs_cpu_seq_lens stays True for it)"
        )
    return torch.as_tensor(x, dtype=torch.int32, device="cpu")


def write_loc(fb: Any) -> torch.Tensor:
    """The physical slot of every new token: SGLang's `out_cache_loc`.

    Hazard: on SGLang's unified memory pool `out_cache_loc` is virtual and the physical slot
    is the `KVWriteLoc.full_loc` its own attention metadata resolves; that pool (and the
    hybrid-SWA one, whose `swa_loc` is another) is refused at start-up
    (`binding._check_pool`), so here `out_cache_loc` is the slot our store kernels write."""
    return fb.out_cache_loc


def eager_batch(fb: Any) -> ForwardBatch:
    """Our batch for an eager (non-graph) SGLang batch. Device work: dtype casts and, for
    decode / verify, the derived lengths; no host sync."""
    mode = _mode(fb)
    bs = int(fb.batch_size)
    dev = fb.seq_lens.device
    rows = fb.req_pool_indices[:bs].to(torch.int32)
    seq = fb.seq_lens[:bs].to(torch.int32)
    seq_cpu = _cpu_i32(fb.seq_lens_cpu, "seq_lens_cpu")[:bs]
    loc = write_loc(fb).to(torch.int64)
    draft = 0
    if mode is ForwardMode.EXTEND:
        if fb.extend_seq_lens is None or fb.extend_prefix_lens is None:
            raise BatchError(f"{fb.forward_mode.name} batch without extend_seq_lens")
        ext = fb.extend_seq_lens[:bs].to(torch.int32)
        pre = fb.extend_prefix_lens[:bs].to(torch.int32)
        ext_cpu = _cpu_i32(fb.extend_seq_lens_cpu, "extend_seq_lens_cpu")
        pre_cpu = _cpu_i32(fb.extend_prefix_lens_cpu, "extend_prefix_lens_cpu")
    else:
        q = _q_len(fb, mode)
        if mode is ForwardMode.TARGET_VERIFY:
            draft = q
            seq, seq_cpu = seq + q, seq_cpu + q
        ext = torch.full((bs,), q, dtype=torch.int32, device=dev)
        ext_cpu = torch.full((bs,), q, dtype=torch.int32)
        pre, pre_cpu = seq - q, seq_cpu - q
    n = int(ext_cpu.sum())
    _check_token_padding(fb, loc.numel(), n)
    loc = loc[:n]
    return ForwardBatch(
        mode=mode,
        req_pool_indices=rows,
        seq_lens=seq,
        seq_lens_cpu=seq_cpu,
        extend_prefix_lens=pre,
        extend_prefix_lens_cpu=pre_cpu,
        extend_seq_lens=ext,
        extend_seq_lens_cpu=ext_cpu,
        out_cache_loc=loc,
        positions=fb.positions[:n],
        num_draft_tokens=draft,
    )


@dataclass
class GraphBuffers:
    """Static storage our graph batches are views of, allocated once for the largest batch.
    Every capture and replay refills the leading rows in place (device copies only), so a
    captured kernel reads the same addresses with new contents."""

    rows: torch.Tensor  # [max_bs] int32
    seq: torch.Tensor  # [max_bs] int32, KV length after the step
    pre: torch.Tensor  # [max_bs] int32
    ext: torch.Tensor  # [max_bs] int32
    loc: torch.Tensor  # [max_tokens] int64
    pos: torch.Tensor  # [max_tokens] int64

    @classmethod
    def allocate(cls, max_bs: int, max_tokens: int, device: torch.device) -> GraphBuffers:
        i32: dict[str, Any] = {"dtype": torch.int32, "device": device}
        i64: dict[str, Any] = {"dtype": torch.int64, "device": device}
        return cls(
            rows=torch.zeros(max_bs, **i32),
            seq=torch.ones(max_bs, **i32),
            pre=torch.zeros(max_bs, **i32),
            ext=torch.ones(max_bs, **i32),
            loc=torch.zeros(max_tokens, **i64),
            pos=torch.zeros(max_tokens, **i64),
        )

    def check(self, fb: Any) -> tuple[ForwardMode, int, int, torch.Tensor]:
        """Host checks of a capture batch or replay view (shapes only): (mode, batch size,
        query tokens per request, the live write slots)."""
        mode = _mode(fb)
        if mode is ForwardMode.EXTEND:
            raise BatchError("CUDA graphs serve DECODE and TARGET_VERIFY batches only")
        bs, q = int(fb.batch_size), _q_len(fb, mode)
        if bs > self.rows.numel() or bs * q > self.loc.numel():
            raise BatchError(
                f"graph batch of {bs} x {q} tokens exceeds init_cuda_graph_state's "
                f"{self.rows.numel()} requests / {self.loc.numel()} tokens"
            )
        live = write_loc(fb)
        _check_live(fb, bs, q, live.numel())
        return mode, bs, q, live

    def load(self, fb: Any) -> ForwardBatch:
        """Our batch over the static buffers for SGLang's capture batch or replay view."""
        mode, bs, q, live = self.check(fb)
        t, n_live = bs * q, live.numel()
        self.rows[:bs].copy_(fb.req_pool_indices[:bs])
        self.seq[:bs].copy_(fb.seq_lens[:bs])
        seq_cpu = _cpu_i32(fb.seq_lens_cpu, "seq_lens_cpu")[:bs]
        if mode is ForwardMode.TARGET_VERIFY:  # SGLang's verify lengths exclude the drafts
            self.seq[:bs].add_(q)
            seq_cpu = seq_cpu + q
        torch.sub(self.seq[:bs], q, out=self.pre[:bs])
        self.ext[:bs].fill_(q)
        self.loc[:n_live].copy_(live)
        self.loc[n_live:t].zero_()  # padded tokens write slot 0 of the dummy page
        positions = getattr(fb, "positions", None)
        if positions is not None and positions.numel() >= t:
            self.pos[:t].copy_(positions[:t])
        return ForwardBatch(
            mode=mode,
            req_pool_indices=self.rows[:bs],
            seq_lens=self.seq[:bs],
            seq_lens_cpu=seq_cpu,
            extend_prefix_lens=self.pre[:bs],
            extend_prefix_lens_cpu=seq_cpu - q,
            extend_seq_lens=self.ext[:bs],
            extend_seq_lens_cpu=torch.full((bs,), q, dtype=torch.int32),
            out_cache_loc=self.loc[:t],
            positions=self.pos[:t],
            num_draft_tokens=q if mode is ForwardMode.TARGET_VERIFY else 0,
        )


def _check_live(fb: Any, bs: int, q: int, live: int) -> None:
    """A graph batch's `live` write slots are those of its leading requests (the rest are
    padding). SGLang's replay view says how many trail (`num_padding`). Hazard: a
    two-batch-overlap child's replay view (`tbo_backend._build_tbo_child_replay_fb_view`)
    carries no `num_padding`, only its slice of the live slots, so that slice says it; a
    capture batch (and the kit's view) carries every slot."""
    pad = getattr(fb, "num_padding", None)
    real = live // q if pad is None else bs - int(pad)
    if live != real * q or not 0 <= real <= bs:
        raise BatchError(f"{live} live slots for {real} of {bs} requests x {q} tokens")


def _check_token_padding(fb: Any, slots: int, n: int) -> None:
    """An eager batch's `slots` write slots for its `n` tokens. Hazard: under DP attention
    SGLang pads the tokens to a multiple of the attention-TP size (to the DP maximum under
    MAX_LEN): whole padded requests in DECODE / TARGET_VERIFY (request row 0, the fill
    length, attended as requests and dropped by SGLang), and trailing tokens past the
    requests' counts, which ours cuts (they would write slot 0). Surplus slots are accepted
    only where SGLang says it padded (`_original_num_tokens`, set by `_pad_inputs_to_size`,
    reset by two-batch overlap's split): elsewhere a surplus slot is a real token whose KV
    would be dropped silently."""
    if slots == n:
        return
    original = getattr(fb, "_original_num_tokens", None)
    if slots < n or original is None or int(original) > n:
        raise BatchError(
            f"out_cache_loc has {slots} slots for {n} tokens"
            + ("" if slots < n else " and the batch is not SGLang's padded one")
        )


def _indptr(lens_dev: torch.Tensor, lens_cpu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dev = torch.zeros(lens_dev.numel() + 1, dtype=torch.int32, device=lens_dev.device)
    torch.cumsum(lens_dev, 0, dtype=torch.int32, out=dev[1:])
    cpu = torch.zeros(lens_cpu.numel() + 1, dtype=torch.int32)
    torch.cumsum(lens_cpu, 0, dtype=torch.int32, out=cpu[1:])
    return dev, cpu


def new_token_layout(batch: ForwardBatch) -> RaggedLayout:
    """MHA-mode prefill over the new tokens only (SGLang's causal first pass): q = kv =
    extend_seq_lens. Device cumsum plus host cumsum: no host-to-device copy."""
    dev, cpu = _indptr(batch.extend_seq_lens, batch.extend_seq_lens_cpu)
    return RaggedLayout(dev, dev, cpu, cpu)


def prefix_chunk_layout(fb: Any, batch: ForwardBatch, chunk: int) -> RaggedLayout:
    """Chunked-prefix MHA, chunk `chunk`: q = the new tokens, kv = each request's rows of
    that prefix chunk (SGLang's `prefix_chunk_cu_seq_lens[chunk]` on the device and
    `prefix_chunk_seq_lens_cpu[chunk]` on the host). Requests with no rows in the chunk give
    out 0 / lse -inf (our contract), which SGLang's merge_state treats as empty."""
    q_dev, q_cpu = _indptr(batch.extend_seq_lens, batch.extend_seq_lens_cpu)
    kv_lens_cpu = _cpu_i32(fb.prefix_chunk_seq_lens_cpu[chunk], "prefix_chunk_seq_lens_cpu")
    kv_cpu = torch.zeros(kv_lens_cpu.numel() + 1, dtype=torch.int32)
    torch.cumsum(kv_lens_cpu, 0, dtype=torch.int32, out=kv_cpu[1:])
    kv_dev = fb.prefix_chunk_cu_seq_lens[chunk].to(torch.int32)
    if kv_dev.numel() != kv_cpu.numel():
        raise BatchError(f"prefix chunk {chunk}: {kv_dev.numel()} vs {kv_cpu.numel()} indptrs")
    return RaggedLayout(q_dev, kv_dev, q_cpu, kv_cpu)
