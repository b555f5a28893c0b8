"""The SGLang adapter under CUDA graphs, driven the way SGLang's decode graph runner drives it
(sglang 0.5.17 `model_executor/runner/decode_cuda_graph_runner.py`): static int64 buffers, a
real ForwardBatch over their slices at capture (`init_forward_metadata_out_graph(fb,
in_capture=True)`, then `init_forward_metadata_in_graph` + the layer inside
`torch.cuda.graph`), and per replay the padded bucket filled like `fill_from` (padded rows:
request row 0, seq_len = fill, slot 0) with the SimpleNamespace view (`num_padding`, live
unpadded `out_cache_loc`) before `graph.replay()`.

Every step: a random subset of requests (changing batch sizes, lengths, page tables), checked
against the MHA-expanded fp64 oracle (`mla_backends.reference`) through w_vc, against the
eager adapter path, with static buffer pointers unchanged, no host sync in the replay
(`torch.cuda.set_sync_debug_mode("error")`), and padded rows never writing a real slot.

GPU: a real `torch.cuda.CUDAGraph` per captured size at DeepSeek-V3 shapes. CPU (CI): the same
harness without capture (the kit's approach), mlab_torch and mlab_triton (interpreter).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import GPU
from sglang_cpu.env import load_sglang

try:
    load_sglang()
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch as SGLBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode as SGLMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.plugins import load_plugins
    from sglang.test.kits.attention_unittest.attention_methods import mla_attention as kit
    from sglang_cpu import kit_support as ks
except Exception as e:  # noqa: BLE001 - any import failure means: cannot run here
    pytest.skip(f"sglang unavailable: {' '.join(str(e).split())[:160]}", allow_module_level=True)

from mla_backends.batch import ForwardBatch, ForwardMode  # noqa: E402
from mla_backends.config import DEEPSEEK_V3, MLADims  # noqa: E402
from mla_backends.integrations.sglang.binding import SettingsError  # noqa: E402
from mla_backends.reference import absorb_q, batch_reference, project_v  # noqa: E402
from mla_backends.testing import TOLERANCES  # noqa: E402

SMALL = MLADims(
    num_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16
)


@pytest.fixture(scope="module", autouse=True)
def plugin() -> Iterator[None]:
    load_plugins()
    undo = None if GPU else ks.use_torch_kv_writer()
    yield
    if undo is not None:
        undo()


@dataclass(frozen=True)
class GraphCase:
    backend: str  # SGLang name
    page: int
    heads: int
    q_len: int = 1  # 1: DECODE, > 1: TARGET_VERIFY (chain drafts)
    fp8: bool = False
    dims: MLADims = DEEPSEEK_V3

    @property
    def id(self) -> str:
        kv = "fp8" if self.fp8 else "bf16"
        return f"{self.backend}-p{self.page}-h{self.heads}-q{self.q_len}-{kv}"


class SGLangGraphHarness:
    """SGLang's decode graph runner in miniature, around one adapter on one layer."""

    def __init__(
        self, case: GraphCase, device: str, sizes: tuple[int, ...], use_graphs: bool
    ) -> None:
        self.case, self.device, self.use_graphs = case, torch.device(device), use_graphs
        self.sizes = sorted(sizes)
        self.rng = random.Random(0)
        self.gen = torch.Generator().manual_seed(0)
        d = case.dims.with_heads(case.heads)
        self.dims, self.q = d, case.q_len
        self.num_requests, self.max_ctx = 12, 1024
        mc = kit.TinyMLAModelConfig(
            num_heads=case.heads,
            kv_lora_rank=d.kv_lora_rank,
            qk_rope_head_dim=d.qk_rope_head_dim,
            hidden_size=64,
            context_len=self.max_ctx,
        )
        mc.qk_nope_head_dim, mc.v_head_dim, mc.scaling = (
            d.qk_nope_head_dim,
            d.v_head_dim,
            d.softmax_scale,
        )
        kit_case = ks.decode_case("graph", case.backend, case.heads, case.page, (1,) * 12)
        self.runner = kit.MockMLAModelRunner(
            case=kit_case,
            model_config=mc,
            dtype=torch.bfloat16,
            device=device,
            max_context_len=self.max_ctx,
            kv_lora_rank=d.kv_lora_rank,
            qk_rope_head_dim=d.qk_rope_head_dim,
            fp8_kv_cache=case.fp8,
            runner_batch_size=self.num_requests,
        )
        self.adapter = ATTENTION_BACKENDS[case.backend](self.runner)
        self.pool = self.runner.token_to_kv_pool
        self.r2t = self.runner.req_to_token_pool.req_to_token
        self.layer = RadixAttention(
            d.num_heads,
            d.kv_dim,
            d.softmax_scale,
            num_kv_heads=1,
            layer_id=0,
            v_head_dim=d.kv_lora_rank,
        )
        self._poison()
        self._free_pages = list(range(1, self.pool.size // case.page + 1))
        self.rng.shuffle(self._free_pages)
        self.lens = dict.fromkeys(range(1, self.num_requests + 1), 0)  # row 0 is reserved
        for r in self.lens:
            self._write_rows(self._extend(r, self.rng.randint(1, 300)))
        self.w_kc = (
            torch.randn(
                d.num_heads,
                d.qk_nope_head_dim,
                d.kv_lora_rank,
                generator=self.gen,
                dtype=torch.float64,
            )
            / d.qk_nope_head_dim**0.5
        )
        self.w_vc = (
            torch.randn(
                d.num_heads, d.kv_lora_rank, d.v_head_dim, generator=self.gen, dtype=torch.float64
            )
            / d.kv_lora_rank**0.5
        )
        self._allocate_static()

    # ------------------------------------------------------------------ pool
    def _poison(self) -> None:
        for buf in self.pool.kv_buffer:
            if buf.dtype == torch.uint8:
                buf.fill_(0x7F)  # NaN in float8_e4m3fn
            else:
                buf.fill_(float("nan"))

    def _extend(self, row: int, n: int) -> torch.Tensor:
        """Slots for n more tokens of request `row` (pages taken in shuffled order); the
        prefix rows written through SGLang's own writer."""
        start, ps = self.lens[row], self.case.page
        slots = []
        for pos in range(start, start + n):
            if pos % ps == 0:
                self.r2t[row, pos] = self._free_pages.pop() * ps
            else:
                self.r2t[row, pos] = self.r2t[row, pos - 1] + 1
            slots.append(int(self.r2t[row, pos]))
        self.lens[row] = start + n
        return torch.tensor(slots, dtype=torch.int64, device=self.device)

    def _write_rows(self, slots: torch.Tensor) -> None:
        d = self.dims
        k = torch.randn(slots.numel(), 1, d.kv_dim, generator=self.gen).to(
            self.device, torch.bfloat16
        )
        self.pool.set_mla_kv_buffer(
            self.layer, slots, k[..., : d.kv_lora_rank], k[..., d.kv_lora_rank :]
        )

    # ------------------------------------------------------------------ static buffers
    def _allocate_static(self) -> None:
        max_bs, q, d, dev = self.sizes[-1], self.q, self.dims, self.device
        t = max_bs * q
        i64 = {"dtype": torch.int64, "device": dev}
        self.s_rows = torch.zeros(max_bs, **i64)
        self.s_seq = torch.ones(max_bs, **i64)
        self.s_seq_cpu = torch.ones(max_bs, dtype=torch.int64)
        self.s_loc = torch.zeros(t, **i64)
        self.s_pos = torch.zeros(t, **i64)
        self.s_ids = torch.zeros(t, **i64)
        bf = {"dtype": torch.bfloat16, "device": dev}
        # q_nope as SGLang makes it: a [H, T, L] bmm result seen as [T, H, L] (strided)
        self.s_q_nope_ht = torch.zeros(d.num_heads, t, d.kv_lora_rank, **bf)
        self.s_q_rope = torch.zeros(t, d.num_heads, d.qk_rope_head_dim, **bf)
        self.s_k_nope = torch.zeros(t, 1, d.kv_lora_rank, **bf)
        self.s_k_rope = torch.zeros(t, 1, d.qk_rope_head_dim, **bf)
        self.fill = self.adapter.get_cuda_graph_seq_len_fill_value()
        self.s_seq.fill_(self.fill)
        self.s_seq_cpu.fill_(self.fill)
        self.adapter.init_cuda_graph_state(max_bs, t)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pointers: dict[int, int] = {}

    @property
    def mode(self) -> Any:
        return SGLMode.DECODE if self.q == 1 else SGLMode.TARGET_VERIFY

    def _capture_batch(self, bs: int) -> Any:
        t = bs * self.q
        return SGLBatch(
            forward_mode=self.mode,
            batch_size=bs,
            input_ids=self.s_ids[:t],
            req_pool_indices=self.s_rows[:bs],
            seq_lens=self.s_seq[:bs],
            seq_lens_cpu=self.s_seq_cpu[:bs],
            out_cache_loc=self.s_loc[:t],
            seq_lens_sum=int(self.s_seq_cpu[:bs].sum()),
            positions=self.s_pos[:t],
        )

    def _forward(self, fb: Any, bs: int) -> torch.Tensor:
        t = bs * self.q
        with forward_context(ForwardContext(attn_backend=self.adapter)):
            return self.layer(
                self.s_q_nope_ht[:, :t].transpose(0, 1),
                self.s_k_nope[:t],
                self.s_k_nope[:t],
                fb,
                q_rope=self.s_q_rope[:t],
                k_rope=self.s_k_rope[:t],
            )

    def capture(self) -> None:
        for bs in reversed(self.sizes):  # largest first, as SGLang captures
            fb = self._capture_batch(bs)
            self.adapter.init_forward_metadata_out_graph(fb, in_capture=True)
            self.pointers[bs] = self.adapter.forward_metadata.batch.seq_lens.data_ptr()
            if not self.use_graphs:
                continue
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self.adapter.init_forward_metadata_in_graph(fb)
                    self._forward(fb, bs)
            torch.cuda.current_stream().wait_stream(stream)
            self.adapter.on_after_cuda_graph_warmup()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.adapter.init_forward_metadata_in_graph(fb)
                self.outputs[bs] = self._forward(fb, bs)
            self.graphs[bs] = graph

    # ------------------------------------------------------------------ one step
    def step(self, n: int) -> dict[str, Any]:
        """n real requests, each q_len new tokens: their prefix rows are in the pool (SGLang's
        writer); the new rows come as k inputs and are stored by the adapter."""
        q, d = self.q, self.dims
        rows = self.rng.sample(sorted(self.lens), n)
        prefix = [self.lens[r] for r in rows]
        loc = torch.cat([self._extend(r, q) for r in rows])
        t = n * q

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=self.gen, dtype=torch.float64)

        q_nope = rnd(t, d.num_heads, d.qk_nope_head_dim)
        return {
            "rows": rows,
            "prefix": prefix,
            "loc": loc,
            "q_nope": q_nope,
            "q_latent": absorb_q(q_nope, self.w_kc).to(self.device, torch.bfloat16),
            "q_rope": rnd(t, d.num_heads, d.qk_rope_head_dim).to(self.device, torch.bfloat16),
            "k_nope": rnd(t, 1, d.kv_lora_rank).to(self.device, torch.bfloat16),
            "k_rope": (2 * rnd(t, 1, d.qk_rope_head_dim)).to(self.device, torch.bfloat16),
        }

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def replay(self, st: dict[str, Any]) -> torch.Tensor:
        """fill_from + the replay view + out_graph, then graph.replay(); real tokens' output."""
        n, q = len(st["rows"]), self.q
        bs, t = self.bucket(n), n * q
        seq = [p + q if q == 1 else p for p in st["prefix"]]  # verify: without the drafts
        dev = self.device
        self.s_rows[:n].copy_(torch.tensor(st["rows"], device=dev))
        self.s_rows[n:bs].zero_()
        self.s_seq[:n].copy_(torch.tensor(seq, device=dev))
        self.s_seq[n:bs].fill_(self.fill)
        self.s_seq_cpu[:n] = torch.tensor(seq)
        self.s_seq_cpu[n:bs] = self.fill
        self.s_loc[:t].copy_(st["loc"])
        self.s_loc[t : bs * q].zero_()
        self.s_q_nope_ht[:, :t].copy_(st["q_latent"].transpose(0, 1))
        self.s_q_rope[:t].copy_(st["q_rope"])
        self.s_k_nope[:t].copy_(st["k_nope"])
        self.s_k_rope[:t].copy_(st["k_rope"])
        view = SimpleNamespace(
            batch_size=bs,
            forward_mode=self.mode,
            actual_forward_mode=self.mode,
            input_ids=self.s_ids[: bs * q],
            positions=self.s_pos[: bs * q],
            req_pool_indices=self.s_rows[:bs],
            seq_lens=self.s_seq[:bs],
            seq_lens_sum=int(self.s_seq_cpu[:bs].sum()),
            seq_lens_cpu=self.s_seq_cpu[:bs],
            num_padding=bs - n,
            encoder_lens=None,
            out_cache_loc=st["loc"],
            spec_info=None,
        )
        with self._no_sync():
            self.adapter.init_forward_metadata_out_graph(view)
            if self.use_graphs:
                self.graphs[bs].replay()
                out = self.outputs[bs]
            else:
                self.adapter.init_forward_metadata_in_graph(view)
                out = self._forward(self._capture_batch(bs), bs)
        if self.adapter.forward_metadata.batch.seq_lens.data_ptr() != self.pointers[bs]:
            raise AssertionError(f"static seq_lens moved after capture of batch size {bs}")
        return out[:t].view(t, self.dims.num_heads, -1)

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        if not self.use_graphs:
            yield
            return
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)

    def eager(self, st: dict[str, Any]) -> torch.Tensor:
        """The same step through the eager adapter path (new rows are stored already)."""
        n, q = len(st["rows"]), self.q
        seq = [p + q if q == 1 else p for p in st["prefix"]]
        dev = self.device
        fb = SGLBatch(
            forward_mode=self.mode,
            batch_size=n,
            input_ids=torch.zeros(n * q, dtype=torch.int64, device=dev),
            req_pool_indices=torch.tensor(st["rows"], device=dev),
            seq_lens=torch.tensor(seq, device=dev),
            seq_lens_cpu=torch.tensor(seq),
            out_cache_loc=st["loc"],
            seq_lens_sum=sum(seq),
            positions=torch.zeros(n * q, dtype=torch.int64, device=dev),
        )
        self.adapter.init_forward_metadata(fb)
        with forward_context(ForwardContext(attn_backend=self.adapter)):
            out = self.layer(
                st["q_latent"], None, None, fb, q_rope=st["q_rope"], save_kv_cache=False
            )
        return out.view(n * q, self.dims.num_heads, -1)

    def oracle(self, st: dict[str, Any]) -> torch.Tensor:
        """MHA-expanded fp64 reference, [T, H, V], over the pool as it is now."""
        n, q = len(st["rows"]), self.q
        mode = ForwardMode.DECODE if q == 1 else ForwardMode.TARGET_VERIFY
        batch = ForwardBatch.build(mode, st["rows"], st["prefix"], [q] * n, st["loc"], self.device)
        pool = self.adapter.binding.kv_pool  # our view of SGLang's buffer
        out, _ = batch_reference(
            pool,
            0,
            self.r2t,
            batch,
            st["q_nope"],
            st["q_rope"].double(),
            self.w_kc,
            self.w_vc,
            self.dims.softmax_scale,
        )
        return out

    def real_rows_fingerprint(self, skip: torch.Tensor) -> torch.Tensor:
        """Every pool row except the dummy page and `skip` (the step's real new slots)."""
        buf = self.pool.kv_buffer[0]
        keep = torch.ones(buf.shape[0], dtype=torch.bool, device=buf.device)
        keep[: self.case.page] = False
        keep[skip] = False
        return buf.view(torch.uint8)[keep].clone()


def run_steps(case: GraphCase, device: str, steps: int, use_graphs: bool, ref_every: int) -> None:
    h = SGLangGraphHarness(case, device, (1, 2, 4, 8), use_graphs)
    h.capture()
    atol, rtol, _ = TOLERANCES["bfloat16"]
    w_vc = h.w_vc.to(h.device)
    for i in range(steps):
        n = (i % 7) + 1  # 1..7 real requests: every bucket but 1, 2, 4 pads
        st = h.step(n)
        before = h.real_rows_fingerprint(st["loc"])
        got = h.replay(st).clone()
        assert torch.equal(h.real_rows_fingerprint(st["loc"]), before), (
            f"step {i}: a padded row wrote a real slot"
        )
        assert torch.isfinite(got).all(), f"step {i}: non-finite output"
        eager = h.eager(st)
        torch.testing.assert_close(got.float(), eager.float(), atol=atol, rtol=rtol)
        if i % ref_every == 0:
            want = h.oracle(st)
            torch.testing.assert_close(
                project_v(got.double(), w_vc).cpu(), want.cpu(), atol=atol, rtol=rtol
            )


CPU_CASES = [
    GraphCase("mlab_torch", page=16, heads=4, dims=SMALL),
    GraphCase("mlab_torch", page=1, heads=4, q_len=3, fp8=True, dims=SMALL),
    GraphCase("mlab_triton", page=16, heads=4, q_len=2, dims=SMALL),
]


@pytest.mark.skipif(GPU, reason="the CPU variant of the GPU graph test")
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, id=c.id, marks=pytest.mark.interp if c.backend == "mlab_triton" else ())
        for c in CPU_CASES
    ],
)
def test_graph_path_without_capture(case: GraphCase) -> None:
    run_steps(case, "cpu", steps=8, use_graphs=False, ref_every=2)


GPU_CASES = [
    GraphCase("mlab_triton", page=64, heads=16),
    GraphCase("mlab_triton", page=64, heads=128),
    GraphCase("mlab_triton", page=16, heads=16, q_len=2, fp8=True),
    GraphCase("mlab_flashmla", page=64, heads=128),
    GraphCase("mlab_flashmla", page=64, heads=16, q_len=2),
    GraphCase("mlab_flashinfer", page=1, heads=128),
    GraphCase("mlab_flashinfer", page=16, heads=16, q_len=2, fp8=True),
    GraphCase("mlab_torch", page=64, heads=16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_cuda_graph_through_sglang_batches(case: GraphCase) -> None:
    assert case.backend in ATTENTION_BACKENDS, "not registered through the entry point"
    try:
        run_steps(case, "cuda", steps=200, use_graphs=True, ref_every=20)
    except SettingsError as e:  # a backend this GPU cannot run: our reason, not a failure
        pytest.skip(str(e))
