"""`bench`: timings of the MLA backends against the raw peer kernels and the copy / matmul
ceilings measured at the start of the same run (CUDA-event medians, random data). Suites:

- grid (default): the config's backends (or --backends) over a grid of heads x q_len x batch
  x kv_len: decode / verify calls, whole decode steps eager vs one CUDA graph (--graphs), raw
  peers (--raw), one MHA-mode prefill (--prefill-tokens); table, grid.json, roofline.png;
- anchors: the decode shapes of the project's reference table (anchors.ANCHOR_SHAPES;
  DeepSeek-V3 dims, page 64, bf16) against raw FlashMLA / FlashInfer fa3 (--peers), then the
  MHA-mode prefill table; anchors.json;
- prefill: MHA-mode prefill of one causal request vs torch SDPA and raw FlashInfer;
  prefill.json;
- stack: real-size DeepSeek-V3 layers decoding through each backend, eager vs whole-model
  CUDA graphs; stack.json, stack.md;
- linear: one KDA / GDN layer's decode vs the raw fla kernels; linear.json, linear.md;
- fi-plan: where the host time of flashinfer_mla's decode metadata goes (GPU); fi-plan.json;
- metadata: each backend's decode metadata host time (GPU); metadata.json;
- hopper: our Hopper decode kernel vs raw FlashMLA / fa3, eager and graph (GPU, --part);
  hopper-PART.json, hopper-PART.md.

Each suite's files are named after it, so suites share an --out folder; a second run of one
suite into the same folder replaces its files. A size that does not fit in memory is one line
naming the options that set it; the decode suites also check each shape's KV pool against a
GPU's free memory before any timing.

Everything runs on a CPU too (rates there are references, not ceilings), except what needs a
GPU kernel package: raw peers and CUDA graphs are left out there, with one line saying so.
"""
