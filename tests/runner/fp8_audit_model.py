"""A model with one fp8 branch whose weight gradients cancel and one whose do not (the fp8
audit's tests, tests/runner/test_fp8_audit.py).

``cancel`` sees inputs that are one vector plus 1% noise (``c + 0.01 n_t``) and a loss
linear in its output with labels of zero mean over the batch, so its output gradients sum
to zero over the tokens: ``dW = sum_t dy_t x_t^T`` keeps only the noise's share, while the
row-wise e4m3 rounding of ``dy`` does not cancel against ``c`` -- the mechanism that took
Wukong's fp8 weight gradients to 6.7-20 dB mid-training (BENCHMARKS.md). ``healthy`` sees
Gaussian inputs under a squared loss: its gradients add up, its GEMMs stay near 28 dB."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemc.spec import ModelSpec

B, D, H, OUT = 64, 32, 64, 16


class Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, H)
        self.down = nn.Linear(H, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cancel = Branch()
        self.healthy = Branch()
        self.norm = nn.LayerNorm(D)  # a kernel outside the fp8 linears: graph mode runs

    def forward(self, x: torch.Tensor, labels: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        a = self.cancel(x).float()
        b = self.healthy(self.norm(z)).float()
        return (a * labels).sum() / B + (b * b).mean()


def make_batch(step: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    c = torch.randn(D, generator=torch.Generator().manual_seed(7))  # the same every step
    g = torch.Generator().manual_seed(1000 + step)
    x = c + 0.01 * torch.randn(B, D, generator=g)
    r = torch.randn(B, OUT, generator=g)
    labels = r - r.mean(0)  # zero mean over the batch: the output gradients cancel
    z = torch.randn(B, D, generator=g)
    return x.to(device), labels.to(device), z.to(device)


def build() -> ModelSpec:
    return ModelSpec(model=Model(), example_inputs=make_batch(0), make_batch=make_batch,
                     info={"batch_size": B})
