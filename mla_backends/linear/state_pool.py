"""Recurrent and short-conv state per request, per linear layer.

The state slot of a request is its request row (`ReqToTokenPool` rows 1..max_requests), so no
second allocator can drift from the first; row / slot 0 is the dummy that padded CUDA-graph
rows read and write. States are fp32 and reset to zero when a request takes a row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mla_backends.batch import as_ints
from mla_backends.pool import check_layer_index


class LinearStatePool:
    def __init__(
        self,
        num_layers: int,
        max_requests: int,
        num_heads: int,
        head_k: int,
        head_v: int,
        conv_dim: int,
        conv_kernel: int,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.device = torch.device(device)
        slots = max_requests + 1
        self.recurrent = torch.zeros(
            num_layers, slots, num_heads, head_k, head_v, dtype=torch.float32, device=self.device
        )
        self.conv = torch.zeros(
            num_layers,
            slots,
            conv_dim,
            max(conv_kernel - 1, 0),
            dtype=torch.float32,
            device=self.device,
        )

    @property
    def bytes_per_request(self) -> int:
        per = self.recurrent[:, 0].numel() + self.conv[:, 0].numel()
        return per * self.recurrent.element_size()

    def check_layer(self, layer: int) -> int:
        """`layer` as an int if it is one of this pool's linear layers, else a LayerIndexError
        (a plain index took -1 as the last layer, silently)."""
        return check_layer_index(layer, self.num_layers, "the state pool has linear layers")

    def reset(self, rows: Sequence[int]) -> None:
        """Zero the states of newly admitted requests (their rows may be reused)."""
        rows = as_ints(rows, "rows")  # a float or bool row reset row 1, silently
        if 0 in rows:
            raise ValueError("row 0 is the dummy state slot, never a request")
        slots = self.recurrent.shape[1]
        bad = [r for r in rows if not 0 < r < slots]  # -1 zeroed the last request's state
        if bad:
            raise ValueError(f"rows {bad} are not request rows (1..{slots - 1})")
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.recurrent[:, idx] = 0
        self.conv[:, idx] = 0
