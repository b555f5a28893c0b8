"""`bench`: timings of the MLA backends against the raw peer kernels and the copy / matmul
ceilings measured at the start of the same run (CUDA-event medians, random data). Suites:

- grid (default): the config's backends (or --backends) over a grid of heads x q_len x batch
  x kv_len: decode / verify calls, whole decode steps eager vs one CUDA graph (--graphs), raw
  peers (--raw), one MHA-mode prefill (--prefill-tokens); table, bench.json, roofline.png;
- anchors: the decode table of ANCHORS.md (DeepSeek-V3 dims, page 64, bf16) against raw
  FlashMLA / FlashInfer fa3 (--peers), then the MHA-mode prefill table; bench.json;
- prefill: MHA-mode prefill of one causal request vs torch SDPA and raw FlashInfer;
- stack: real-size DeepSeek-V3 layers decoding through each backend, eager vs whole-model
  CUDA graphs; stack.json, stack.md;
- linear: one KDA / GDN layer's decode vs the raw fla kernels; linear.json, linear.md;
- fi-plan: where the host time of flashinfer_mla's decode metadata goes (GPU); fi-plan.json.

Everything runs on a CPU too (rates there are references, not ceilings), except what needs a
GPU kernel package: raw peers and CUDA graphs are left out there, with one line saying so.
"""
