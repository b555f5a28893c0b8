"""DeepSeek Sparse Attention (DeepSeek-V3.2): the lightning indexer and sparse MLA backends.

- `quant`: Hadamard rotation and ue8m0 e4m3 block quantisation (one definition for all).
- `fp8_row`: the 656-byte FlashMLA V3.2 FP8 latent row and its pool.
- `indexer`: the index-K cache (page-major, beside the latent pool), the indexer maths in
  torch, and the per-layer step; `indexer_kernels`: its Triton store and logits kernels.
- `base`: the sparse attention contract, registry and the dense/sparse rule; backends
  `torch_backend`, `triton_backend` (+ `triton_kernel`, and on SM90 `gluon_kernel` /
  `gluon_fp8row`), `flashmla`, `flashinfer_mla`;
  `reference`: the fp64 oracle; `testing`: the parity harness.
- `dsa`: `DSABackend`, what a V3.2 model calls (dense backend + indexer + sparse backend).
"""
