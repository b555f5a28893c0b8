"""FlashInfer-MLA and FlashMLA: clear refusals where they cannot run (CPU, CI), and on a GPU
no-sync metadata within its host-time budget and strided views (their parity matrix, batch
sizes and MHA prefill are rows of tests/parity.py)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from conftest import GPU

from mla_backends.backends.base import Capability
from mla_backends.backends.registry import get_backend_class
from mla_backends.config import DEEPSEEK_V3, Config, ConfigError, config_from_dict

H100 = Capability("cuda", (9, 0), "NVIDIA H100 80GB HBM3")
A100 = Capability("cuda", (8, 0), "NVIDIA A100")


def _has(pkg: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(pkg) is not None


# ---------------------------------------------------------------------------- CPU / CI
@pytest.mark.parametrize("name", ["flashmla", "flashinfer_mla"])
def test_choosing_a_gpu_kernel_here_fails_at_load_saying_what_is_missing(name: str) -> None:
    if GPU and _has("flashinfer") and _has("sgl_kernel"):
        pytest.skip("this machine can run it")
    raw = {
        "model": "deepseek-v3",
        "decode_backend": name,
        "prefill_backend": "auto",
        "page_size": 64,
        "device": "cpu",
    }
    with pytest.raises(
        ConfigError,
        match=rf"decode_backend='{name}' cannot run here: .*"
        r"(not installed|needs a CUDA GPU)",
    ):
        config_from_dict(raw, "x.yaml")


def test_a_missing_package_hint_names_each_install_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """flashmla takes flash_mla or sgl_kernel: the hint said "pip install sglang-kernel" twice."""
    import importlib.util

    from mla_backends.backends import kernel_packages

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    msg = kernel_packages.missing("flash_mla", "sgl_kernel")
    assert msg is not None and msg.count("pip install sglang-kernel==0.4.3") == 1
    assert "build deepseek-ai/FlashMLA" in msg


def test_a_kernel_package_of_another_release_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang 0.5.17 pins flashinfer-python 0.6.15.post1: a backend importing it says, once,
    which release the suite was checked with; the checked release and unknown packages say
    nothing."""
    import importlib
    import importlib.metadata
    import types

    from mla_backends.backends import kernel_packages

    installed = {"flashinfer-python": "0.6.15.post1", "sglang-kernel": "0.4.3"}
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: installed[dist])
    monkeypatch.setattr(importlib, "import_module", lambda name: types.ModuleType(name))
    kernel_packages.warn_unchecked.cache_clear()
    with caplog.at_level("WARNING", logger=kernel_packages.__name__):
        for module in ("flashinfer", "flashinfer.decode", "sgl_kernel.flash_mla", "numpy"):
            kernel_packages.require(module)
    assert [r.getMessage() for r in caplog.records] == [
        "flashinfer-python 0.6.15.post1 is installed; mla-backends was checked with "
        "0.7.2.post1 only (mla-backends[gpu]): if a backend over it fails or disagrees, "
        "install flashinfer-python==0.7.2.post1"
    ]


@pytest.mark.parametrize(
    "installed, warned",
    [
        ({"sglang-kernel": "0.4.3+cu130"}, None),  # a CUDA build of the checked release
        ({"sgl-kernel": "0.3.9"}, "sgl-kernel 0.3.9 is installed"),  # its name before 0.4
        ({}, None),  # no distribution: a source tree or a bundle
    ],
    ids=["local-label", "old-name", "none"],
)
def test_kernel_package_warning_reads_local_labels_and_old_names(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    installed: dict,
    warned: str | None,
) -> None:
    import importlib.metadata

    from mla_backends.backends import kernel_packages

    def version(dist: str) -> str:
        if dist not in installed:
            raise importlib.metadata.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(importlib.metadata, "version", version)
    kernel_packages.warn_unchecked.cache_clear()
    with caplog.at_level("WARNING", logger=kernel_packages.__name__):
        kernel_packages.warn_unchecked("sgl_kernel")
    got = [r.getMessage() for r in caplog.records]
    if warned is None:
        assert got == []
    else:
        assert len(got) == 1 and got[0].startswith(warned), got


T4 = Capability("cuda", (7, 5), "T4")


@pytest.mark.parametrize(
    "name, cfg, cap, pattern",
    [
        ("flashmla", {"page_size": 16}, H100, r"needs page_size in \(64,\), config has 16"),
        ("flashmla", {}, A100, r"FlashMLA needs SM 90, found NVIDIA A100 \(SM80\)"),
        ("flashmla", {"kv_dtype": "float32"}, H100, r"needs kv_dtype in"),
        ("flashmla", {"kv_dtype": "float8_e4m3fn"}, H100, r"needs kv_dtype in"),
        (
            "flashmla",
            {"kv_dtype": "float16"},
            H100,
            r"q and KV in one dtype: config dtype is bfloat16, kv_dtype is float16$",
        ),
        (
            "flashmla",
            {"model": dataclasses.replace(DEEPSEEK_V3, kv_lora_rank=256)},
            H100,
            r"built for kv_lora_rank 512 \+ rope 64",
        ),
        (
            "flashmla",
            {"dtype": "float32"},
            H100,
            r"takes bfloat16/float16 activations, config dtype is float32",
        ),
        ("flashinfer_mla", {"kv_dtype": "float8_e4m3fn"}, A100, r"FP8 MLA needs fa3 \(SM90\)"),
        ("flashinfer_mla", {}, Capability("cpu"), r"needs a CUDA GPU"),
        # one GPU, one reason: with FP8 KV the SM the FP8 path needs, alone
        ("flashinfer_mla", {}, T4, r"^FlashInfer MLA needs SM 80 or 86 or 89 or 90, found T4"),
        (
            "flashinfer_mla",
            {"kv_dtype": "float8_e4m3fn"},
            T4,
            r"^FlashInfer FP8 MLA needs fa3 \(SM90\), found T4 \(SM75\)$",
        ),
        ("triton", {}, T4, r"^triton MLA kernels need SM80 or newer, found T4 \(SM75\)$"),
        (
            "triton",
            {"kv_dtype": "float8_e4m3fn"},
            T4,
            r"^FP8 KV needs SM89 or newer, found T4 \(SM75\)$",
        ),
        # every reason at once, the machine's too: one at a time sent users to fix the page
        # size first, only to be told then that the GPU cannot run the backend
        (
            "flashmla",
            {"page_size": 16, "kv_dtype": "float32"},
            A100,
            r"^flashmla needs page_size in \(64,\), config has 16; flashmla needs kv_dtype in "
            r"\('bfloat16', 'float16'\), config has 'float32' \(q and KV in one dtype: dtype is "
            r"'bfloat16'\); FlashMLA needs SM 90, found ",
        ),
    ],
)
def test_capability_reasons(
    monkeypatch: pytest.MonkeyPatch, name: str, cfg: dict, cap: Capability, pattern: str
) -> None:
    import mla_backends.backends.flashinfer_kernel as fi
    import mla_backends.backends.flashmla as fm

    # pretend the packages exist, so the other checks are exercised on any machine
    monkeypatch.setattr(fm, "missing", lambda *a: None)
    monkeypatch.setattr(fi, "missing", lambda *a: None)
    base = {"model": DEEPSEEK_V3, "page_size": 64, "device": "cpu"}
    config = Config(**{**base, **cfg})
    reason = get_backend_class(name).supports(config, cap, "decode")
    assert reason is not None and __import__("re").search(pattern, reason), reason


ONE_DTYPE = [
    # (name, page, cap, kv_dtype, dtype, the whole refusal)
    ("flashmla", 64, H100, "float8_e4m3fn", "bfloat16",
     "flashmla needs kv_dtype in ('bfloat16', 'float16'), config has 'float8_e4m3fn' "
     "(q and KV in one dtype: dtype is 'bfloat16')"),
    ("flashmla", 64, H100, "float8_e4m3fn", "float16",
     "flashmla needs kv_dtype in ('bfloat16', 'float16'), config has 'float8_e4m3fn' "
     "(q and KV in one dtype: dtype is 'float16')"),
    ("flashmla", 64, H100, "bfloat16", "float32",
     "flashmla takes bfloat16/float16 activations, config dtype is float32 "
     "(q and KV in one dtype)"),
    ("flashmla", 64, H100, "float8_e4m3fn", "float32",
     "flashmla needs kv_dtype in ('bfloat16', 'float16'), config has 'float8_e4m3fn'; "
     "flashmla takes bfloat16/float16 activations, config dtype is float32 "
     "(q and KV in one dtype)"),
    ("flashmla", 64, H100, "bfloat16", "float16",
     "flashmla needs q and KV in one dtype: config dtype is float16, kv_dtype is bfloat16"),
    ("cutlass_mla", 128, Capability("cuda", (10, 0), "NVIDIA B200"), "float8_e4m3fn",
     "bfloat16",
     "cutlass_mla needs kv_dtype in ('bfloat16', 'float16'), config has 'float8_e4m3fn' "
     "(q and KV in one dtype: dtype is 'bfloat16')"),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, page, cap, kv, act, want",
    ONE_DTYPE,
    ids=[f"{n}-kv_{kv}-dtype_{a}" for n, _, _, kv, a, _ in ONE_DTYPE],
)
def test_q_and_kv_in_one_dtype_refusals_state_each_cause_once(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    page: int,
    cap: Capability,
    kv: str,
    act: str,
    want: str,
) -> None:
    """An FP8 pool on FlashMLA (CUTLASS too) was refused as "needs kv_dtype in ..." and again
    as "needs q and KV in one dtype": one cause, the KV dtype, said twice. Each wrong
    setting is now one reason, and the q / KV pairing stays in it."""
    import mla_backends.backends.cutlass_mla as cm
    import mla_backends.backends.flashmla as fm

    monkeypatch.setattr(fm, "missing", lambda *a: None)  # as if installed
    monkeypatch.setattr(cm, "missing", lambda *a: None)
    config = Config(model=DEEPSEEK_V3, page_size=page, device="cpu", kv_dtype=kv, dtype=act)
    assert get_backend_class(name).supports(config, cap, "decode") == want


MACHINE_REASONS = {
    "flashmla": ["PKG", "FlashMLA needs SM 90, found T4 (SM75)", "FlashMLA is built for"],
    "cutlass_mla": ["PKG", "CUTLASS MLA needs SM 100, found T4 (SM75)", "CUTLASS MLA is built for",
                    "CUTLASS MLA takes <= 128 heads, got 256"],
    # FP8 KV: one GPU, one reason, the one whose fix runs it (SM90, not the SM80 list)
    "flashinfer_mla": ["PKG", "FlashInfer FP8 MLA needs fa3 (SM90), found T4 (SM75)",
                       "FlashInfer MLA is built for",
                       "FlashInfer MLA takes bfloat16/float16 activations, config dtype is "
                       "float32"],
    "trtllm_mla": ["PKG", "TRT-LLM MLA needs SM 100 or 103, found T4 (SM75)",
                   "TRT-LLM MLA is built for",
                   "TRT-LLM MLA takes bfloat16 activations, config dtype is float32"],
    "triton": ["PKG", "FP8 KV needs SM89 or newer, found T4 (SM75)",
               "triton MLA kernels need kv_lora_rank and qk_rope_head_dim to be powers of two"],
}  # fmt: skip


@pytest.mark.parametrize("name", list(MACHINE_REASONS))
def test_dense_machine_reasons_give_every_reason_at_once(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """The dense `_machine_reason`s stopped at the first reason (`a or b`), where the sparse
    ones join them all: a user installed the package only to be told next that the GPU, the
    dims or the dtype cannot run the backend either."""
    import mla_backends.backends.cutlass_mla as cm
    import mla_backends.backends.flashinfer_mla as fi
    import mla_backends.backends.flashmla as fm
    import mla_backends.backends.triton_backend as tb
    import mla_backends.backends.trtllm_mla as tm

    for module in (fm, cm, tm):
        monkeypatch.setattr(module, "missing", lambda *a: "PKG")
    monkeypatch.setattr(fi, "fa3_unusable", lambda: "PKG")
    monkeypatch.setattr(tb, "need_triton", lambda device_type: "PKG")
    dims = dataclasses.replace(DEEPSEEK_V3, kv_lora_rank=384, num_heads=256)
    config = Config(model=dims, page_size=64, device="cpu", dtype="float32",
                    kv_dtype="float8_e4m3fn")  # fmt: skip
    reason = get_backend_class(name)._machine_reason(config, T4)
    got = [] if reason is None else reason.split("; ")
    want = MACHINE_REASONS[name]
    assert len(got) == len(want) and all(g.startswith(w) for g, w in zip(got, want)), got


def test_flashmla_has_no_prefill_path() -> None:
    reason = get_backend_class("flashmla").supports(Config(page_size=64), H100, "prefill")
    assert reason is not None and "no prefill path" in reason


# ---------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("page", [1, 64])
def test_gpu_flashinfer_strided_views_equal_contiguous(page: int) -> None:
    from mla_backends.bench.fixtures import decode_setup

    s = decode_setup("flashinfer_mla", 16, 1, 8, 300, page_size=page)
    be = s.rt.backend
    be.init_forward_metadata(s.batch)
    ckv, kpe = s.rt.kv_pool.get_ckv_kpe(0)
    assert not ckv.is_contiguous()
    out = torch.empty_like(s.q_nope)
    lse = torch.empty(s.q_nope.shape[:2], device="cuda")
    plan, q = be.metadata.plan, (s.q_nope, s.q_rope)
    be.kernel.run(plan, q, (ckv, kpe), out, lse, 1.0)
    out2, lse2 = torch.empty_like(out), torch.empty_like(lse)
    be.kernel.run(plan, q, (ckv.contiguous(), kpe.contiguous()), out2, lse2, 1.0)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def _metadata_host_times(name: str) -> list[float]:
    """Host seconds of init_forward_metadata for a decode batch of 256, sync debug "error"
    (any device-to-host sync raises), each call behind ~25 ms of queued GPU work (a hidden
    sync would wait for it). A synchronize every third call keeps at most 3 batches in
    flight, as in serving. (The host time itself, which depends on the host CPU, is the
    `bench --suite metadata` benchmark, not an assertion.)"""
    from mla_backends.bench.fixtures import decode_setup

    s = decode_setup(name, 16, 1, 256, 1024)
    be = s.rt.backend
    for _ in range(5):
        be.init_forward_metadata(s.batch)  # warm up (JIT, allocator)
    torch.cuda.synchronize()
    times = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(30):
            if i % 3 == 0:
                torch.cuda.set_sync_debug_mode(0)
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            torch.cuda._sleep(50_000_000)
            t0 = time.perf_counter()
            be.init_forward_metadata(s.batch)
            times.append(time.perf_counter() - t0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return times


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flashinfer_mla", "flashmla"])
def test_gpu_decode_metadata_does_not_wait_for_the_gpu(name: str) -> None:
    times = _metadata_host_times(name)
    assert max(times) < 5e-3, f"{name}: a metadata call waited for the GPU ({max(times):.4f} s)"


def test_flashinfer_host_lengths_equal_the_torch_indptrs() -> None:
    """The planner's host inputs (numpy, from the batch's CPU copies) equal the shared torch
    builders' indptrs, including an empty request and a page-boundary length."""
    from mla_backends.arith import cumsum_indptr
    from mla_backends.backends.flashinfer_kernel import host_lengths
    from mla_backends.batch import ForwardBatch, ForwardMode

    for mode, prefix, ext in (
        (ForwardMode.TARGET_VERIFY, [5, 0, 126, 64], [2, 2, 2, 2]),
        (ForwardMode.EXTEND, [0, 3, 0, 200], [0, 7, 64, 1]),
    ):
        b = ForwardBatch.build(
            mode, [1, 2, 3, 4], prefix, ext, torch.zeros(sum(ext), dtype=torch.long), "cpu"
        )
        for page in (1, 64):
            h = host_lengths(b, page)
            seq = b.seq_lens_cpu.to(torch.int32)
            want_kv = cumsum_indptr((seq + page - 1) // page)
            assert torch.equal(torch.from_numpy(h.kv_indptr), want_kv)
            want_qo = cumsum_indptr(b.extend_seq_lens_cpu.to(torch.int32))
            assert torch.equal(torch.from_numpy(h.qo_indptr), want_qo)
            assert torch.equal(torch.from_numpy(h.seq), seq)


@pytest.mark.parametrize("name, page", [("cutlass_mla", 128), ("trtllm_mla", 32)])
def test_vendor_kernels_refuse_a_query_of_another_dtype(
    emulated: None, name: str, page: int
) -> None:
    """Kernels built for the config's dtype (FlashInfer's module, FlashMLA, CUTLASS, TRT-LLM):
    an fp16 query over a bf16 config failed inside the kernel call, after the new rows were
    stored (or, through FlashInfer's raw module, was not refused at all); now q_nope is named
    before anything is stored."""
    from mla_backends.batch import ForwardMode
    from mla_backends.checks import ShapeError
    from mla_backends.testing import Case, build_case

    case = Case(name, ForwardMode.DECODE, page, 16, "bfloat16", "bfloat16", 1, (5, 40))
    rt, batch = build_case(case, torch.device("cpu"))
    rt.backend.init_forward_metadata(batch)
    q = torch.randn(2, 16, 512).half(), torch.randn(2, 16, 64).half()
    k = torch.randn(2, 512).half(), torch.randn(2, 64).half()
    before = rt.kv_pool.kv_buffer[0].view(torch.int16).clone()
    with pytest.raises(ShapeError, match=r"q_nope: expected dtype in \['torch.bfloat16'\]"):
        rt.backend.forward_absorbed(0, *q, *k, batch)
    assert torch.equal(rt.kv_pool.kv_buffer[0].view(torch.int16), before)


def test_flashmla_schedule_counts_q_len_times_heads_rows() -> None:
    """FlashMLA's metadata takes q_len x H query rows a KV head. The dense backend has no CPU
    emulation, so H alone survived every CPU test (helper 75)."""
    from types import SimpleNamespace

    from mla_backends.backends.flashmla import FlashMLABackend

    calls: list[tuple[list[int], int, int]] = []

    def meta(lens: torch.Tensor, rows: int, heads_k: int) -> tuple[None, None]:
        calls.append((lens.tolist(), rows, heads_k))
        return None, None

    be = FlashMLABackend.__new__(FlashMLABackend)
    be._fm = SimpleNamespace(get_mla_metadata=meta)
    be.dims = SimpleNamespace(num_heads=16)
    be._schedule(torch.tensor([7, 9], dtype=torch.int32), 3)
    be._schedule(torch.tensor([7, 9], dtype=torch.int32), 1)
    assert calls == [([7, 9], 48, 1), ([7, 9], 16, 1)]
