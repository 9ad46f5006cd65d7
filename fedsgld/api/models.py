"""Which user models a private run can train, checked before any work (:func:`check_model`).

DP needs each record's own gradient g_i = grad l(theta; x_i, y_i), to clip it. Two paths
compute them (:class:`fedsgld.core.mechanism.FlatModel`):

* ``layers`` (fast, exact): every trainable parameter sits in an ``nn.Linear`` or an
  ``nn.Conv2d`` (groups 1, zero padding), each layer called once per forward pass; any
  parameter-free layer (activations, pooling, flatten, reshapes) and any frozen
  (``requires_grad=False``) parameter may sit between them
  (:mod:`fedsgld.core.grad_samplers`).
* ``func``: anything else that ``torch.func.vmap(torch.func.grad(...))`` can run on one
  record at a time (LayerNorm, GroupNorm, Embedding, Conv1d, attention, ...), slower.

Refused, in one line naming the layer: layers in training mode that couple the records
of a batch (BatchNorm, InstanceNorm tracking running statistics: a record's gradient
would depend on the others, so clipping it would not bound one record's influence), and
layers in training mode that draw random numbers in the forward pass (Dropout), which
``torch.func`` cannot vectorise. In eval mode (``.eval()``: BatchNorm then uses its fixed
running statistics) both treat records independently and are accepted.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from torch import nn

from fedsgld.core.mechanism import FlatModel

_COUPLING = (nn.modules.batchnorm._BatchNorm,)
_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout)


class ClassCountError(ValueError):
    """The model returns logits of another class count than the labels imply
    (``returned``: the model's, None where its output is not (batch, classes))."""

    def __init__(self, message: str, returned: int | None) -> None:
        super().__init__(message)
        self.returned = returned


def _where(name: str) -> str:
    return f"at {name!r}" if name else "(the whole model)"


def refused_layer(model: nn.Module) -> str | None:
    """Why ``model`` cannot be trained with per-record gradients, naming the first layer
    that prevents it (None: no such layer)."""
    for name, m in model.named_modules():
        kind = type(m).__name__
        if m.training and (
            isinstance(m, _COUPLING)
            or (isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.track_running_stats)
        ):
            return (
                f"model: {kind} {_where(name)} couples the records of a batch in training mode, "
                "so one record's gradient (which DP clips) is undefined; use GroupNorm or "
                "LayerNorm, or freeze it with .eval() (its running statistics)"
            )
        if m.training and isinstance(m, _RANDOM) and m.p > 0:
            return (
                f"model: {kind} {_where(name)} draws random masks, which per-record "
                "gradients by torch.func cannot vectorise; remove it (DP noise regularises)"
            )
    return None


def check_model(
    model_fn: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, num_classes: int
) -> str:
    """Build ``model_fn()`` and compute per-record gradients of two records; the path that
    will be used (``layers`` or ``func``). ValueError in one line if the model cannot."""
    with torch.random.fork_rng(devices=[]):
        model = model_fn()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model: the factory must return a torch.nn.Module, got {type(model)}")
    why = refused_layer(model)
    if why is not None:
        raise ValueError(why)
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("model: no trainable parameter (every requires_grad is False)")
    xs, ys = x[:2], y[:2]
    with torch.no_grad():
        try:
            out = model(xs)
        except Exception as err:  # noqa: BLE001 - the user's model, reported in one line
            raise ValueError(f"model: fails on records of shape {tuple(x.shape[1:])}: "
                             f"{type(err).__name__}: {str(err).splitlines()[0]}") from err  # fmt: skip
    if tuple(out.shape) != (xs.shape[0], num_classes):
        two_d = out.dim() == 2 and out.shape[0] == xs.shape[0]
        raise ClassCountError(
            f"model: returns shape {tuple(out.shape)} for {xs.shape[0]} records; logits of "
            f"shape ({xs.shape[0]}, {num_classes}) expected (num_classes={num_classes})",
            int(out.shape[1]) if two_d else None,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fallback to torch.func is reported as the path
        fm = FlatModel(model)
        try:
            fm.per_record_grads(fm.flatten(), xs, ys)
        except Exception as err:  # noqa: BLE001 - reported in one line
            first = (str(err).splitlines() or [""])[0]
            raise ValueError(
                f"model: per-record gradients fail ({type(err).__name__}: {first}); every "
                "layer must treat records independently (see docs/python-api.md)"
            ) from err
    return fm.grad_path


__all__ = ["ClassCountError", "check_model", "refused_layer"]
