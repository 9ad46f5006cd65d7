"""The small CNN for 28x28 grey images used for MNIST-type experiments.

This is the two-convolution tanh network that is standard in DP-SGD work on MNIST
(Papernot et al. 2020, "Tempered sigmoid activations"; the Opacus and TF-Privacy MNIST
examples), with no BatchNorm, since per-record gradients and batch statistics do not mix:

    input              1 x 28 x 28
    Conv2d(1, 16, 8, stride=2, padding=3)  -> 16 x 14 x 14, tanh
    MaxPool2d(2, stride=1)                 -> 16 x 13 x 13
    Conv2d(16, 32, 4, stride=2)            -> 32 x 5 x 5,   tanh
    MaxPool2d(2, stride=1)                 -> 32 x 4 x 4
    Flatten                                -> 512
    Linear(512, 32), tanh
    Linear(32, num_classes)                -> logits

26,010 parameters for 10 classes.
"""

from __future__ import annotations

import torch
from torch import nn


class PaperCNN(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, stride=2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, stride=2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.conv1(x))
        x = nn.functional.max_pool2d(x, 2, 1)
        x = torch.tanh(self.conv2(x))
        x = nn.functional.max_pool2d(x, 2, 1)
        x = torch.tanh(self.fc1(x.flatten(1)))
        return self.fc2(x)
