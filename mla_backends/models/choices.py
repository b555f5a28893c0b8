"""The discrete choices of a model run (DeepSeek-V3.2 index selections, MoE expert routes),
recorded by `run`'s served run and followed by its fp64-reference run, so that the logits it
compares measure the attention backends and not a flipped near-tie."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from mla_backends.models.deepseek_v3 import Gate


@dataclass
class Selections:
    """A run's discrete choices in call order, which the reference run follows: the
    DeepSeek-V3.2 indexer's selections and the MoE gates' expert routes. Hazard: past layer
    0 both read activations that the two runs' attention rounds differently, so in bf16 a
    near-tie can flip a selected slot or an expert, and the logits would then measure that
    flip, not the attention backends (one flipped route of 96 in the tiny random V3.2 moves
    its logits by ~100 %: BENCHMARKS, seventh session). Layer 0's indexer reads the same
    inputs in both runs: there the reference must pick the same sets on its own
    (`layer0_same` of `layer0_calls`); route flips are counted (`routes_differ` of
    `routes`), not refused."""

    picked: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    routed: list[torch.Tensor] = field(default_factory=list)
    layer0_calls: int = 0
    layer0_same: int = 0
    routes: int = 0
    routes_differ: int = 0

    def record(self, indexer: Any) -> None:
        own = indexer.select

        def select(layer: int, *args: Any) -> torch.Tensor:
            out = own(layer, *args)
            self.picked.append((layer, out.clone()))
            return out

        indexer.select = select

    def follow(self, indexer: Any) -> None:
        own = indexer.select

        def select(layer: int, *args: Any) -> torch.Tensor:
            mine = own(layer, *args)
            lead_layer, theirs = self.picked.pop(0)
            if lead_layer != layer or theirs.shape != mine.shape:
                raise RuntimeError("run: the reference run's indexer calls do not line up")
            if layer == 0:
                self.layer0_calls += 1
                same = torch.equal(mine.sort(-1).values, theirs.sort(-1).values)
                self.layer0_same += int(same)
            return theirs

        indexer.select = select

    def gates(self, model: torch.nn.Module, follow: bool) -> None:
        """Record (the served run) or follow (the reference run) every MoE gate's routes."""
        for gate in (m for m in model.modules() if isinstance(m, Gate)):
            gate.routes = self._follow_route if follow else self._record_route

    def ungate(self, model: torch.nn.Module) -> None:
        for gate in (m for m in model.modules() if isinstance(m, Gate)):
            gate.routes = None

    def _record_route(self, idx: torch.Tensor) -> torch.Tensor:
        self.routed.append(idx.clone())
        return idx

    def _follow_route(self, idx: torch.Tensor) -> torch.Tensor:
        theirs = self.routed.pop(0)
        if theirs.shape != idx.shape:
            raise RuntimeError("run: the reference run's expert routes do not line up")
        self.routes += idx.shape[0]
        same = (idx.sort(-1).values == theirs.sort(-1).values).all(-1)
        self.routes_differ += int((~same).sum())
        return theirs
