"""The models a run can train, by name (:func:`build_model`).

None uses BatchNorm: per-record gradients need per-record losses. ``timm_head`` is the
trainable head over a frozen backbone's features (:mod:`fedsgld.models.backbone`; the
backbone itself, and timm, load only when features are computed)."""

from __future__ import annotations

import torch
from torch import nn

from fedsgld.config.checks import is_import_path
from fedsgld.models.backbone import DenseHead
from fedsgld.models.cnn import PaperCNN
from fedsgld.models.imported import build_imported


class LogisticRegression(nn.Module):
    """Multinomial logistic regression: logits = W x + b on flattened inputs."""

    def __init__(self, in_features: int, num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.flatten(1))


class MLP(nn.Module):
    """Two hidden tanh layers on flattened inputs (no normalisation layers)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_features, hidden),
            nn.Tanh(),
            nn.Linear(hidden, hidden),
            nn.Tanh(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


MODELS = ("cnn", "mlp", "logreg", "timm_head")


def build_model(
    name: str, *, input_shape: tuple[int, ...], num_classes: int, hidden: int = 64
) -> nn.Module:
    """Build a model by name for inputs of ``input_shape`` (one record, no batch axis).

    ``timm_head`` is the trainable part of a frozen-backbone model: its inputs are the
    backbone's features (see ``fedsgld.models.backbone``)."""
    if is_import_path(name):  # a user's factory, "package.module:function"
        return build_imported(name)
    in_features = 1
    for s in input_shape:
        in_features *= int(s)
    if name == "cnn":
        if tuple(input_shape) != (1, 28, 28):
            raise ValueError(
                f"model 'cnn' needs 1x28x28 images, got input shape {tuple(input_shape)}"
            )
        return PaperCNN(num_classes=num_classes)
    if name == "mlp":
        return MLP(in_features, num_classes, hidden=hidden)
    if name == "timm_head":
        return DenseHead(in_features, num_classes, hidden=hidden)
    if name == "logreg":
        return LogisticRegression(in_features, num_classes)
    raise ValueError(f"model must be one of {', '.join(MODELS)}; got {name!r}")


__all__ = ["MLP", "MODELS", "LogisticRegression", "PaperCNN", "build_model"]
