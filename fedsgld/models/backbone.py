"""A frozen timm backbone whose features feed two trainable dense layers.

Only the head is trained (privately): the backbone is fixed and touches no gradient, so
its features are computed once per site and reused every round, and training runs at the
speed of the dense layers. Pretrained weights load from a local file when given
(``backbone_weights``); nothing is downloaded: the backbone is a plain timm name, never a
path or a hub name, and a site's process is offline (:func:`offline`). Without weights the
backbone is randomly initialised and a loud warning says so: random features make a weak
(but still valid) classifier.

Features are computed in batches (bounded memory) and cached on disk under
``$FEDSGLD_CACHE`` (default ``~/.cache/fedsgld/features``), keyed by a hash of the input
tensor, the backbone name, the weights file's contents and the image size.
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from fedsgld.config.checks import plain_model_name


class DenseHead(nn.Module):
    """Two dense layers on backbone features: Linear(F, hidden), tanh, Linear(hidden, classes)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


# what timm (through huggingface_hub) and transformers honour: no download, no hub request
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
}


def offline() -> None:
    """Model building in this process never reaches the network: the offline flags set in
    its environment, and in huggingface_hub where it is already imported (it reads them
    once, at import). A site's process calls this when it starts."""
    os.environ.update(OFFLINE_ENV)
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        hub.HF_HUB_OFFLINE = True


def load_backbone(name: str, *, weights: str | None = None, in_chans: int = 1) -> nn.Module:
    """A timm model without its classifier (``num_classes=0``), frozen, in eval mode.
    ``name`` is a plain timm name (never a path or a hub name: nothing is read or
    downloaded for it), checked before timm is imported."""
    plain_model_name("backbone", name)
    import timm  # an optional heavy dependency, imported only where a backbone is built

    try:
        model = timm.create_model(name, pretrained=False, num_classes=0, in_chans=in_chans)
    except RuntimeError as err:  # unknown model name
        raise ValueError(f"backbone {name!r} is not a timm model: {err}") from err
    if weights:
        if not Path(weights).is_file():
            raise ValueError(f"backbone_weights {weights!r} does not exist")
        state = torch.load(weights, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and "state_dict" in state:
            state = state["state_dict"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        bad_missing = [k for k in missing if not k.startswith(("classifier", "fc", "head"))]
        if bad_missing:
            raise ValueError(
                f"backbone_weights {weights!r} lacks {len(bad_missing)} backbone tensors, e.g. {bad_missing[:3]}"
            )
        if unexpected:
            warnings.warn(
                f"backbone_weights: ignored {len(unexpected)} unexpected tensors", stacklevel=2
            )
    else:
        warnings.warn(
            f"NO PRETRAINED WEIGHTS for backbone {name!r}: it is RANDOMLY INITIALISED. Give "
            "backbone_weights=/path/to/weights.pth (a timm state dict) for meaningful features.",
            stacklevel=2,
        )
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@torch.no_grad()
def extract_features(
    backbone: nn.Module, x: torch.Tensor, *, image_size: int, batch: int = 64
) -> torch.Tensor:
    """Features of images ``x`` (N, C, H, W), resized to ``image_size``, in batches.

    Runs on the backbone's device (each batch is moved there); the features come back on
    ``x``'s device."""
    first = next(backbone.parameters(), None)
    device = first.device if first is not None else x.device
    out = []
    for xb in x.split(batch):
        xb = xb.to(device)
        if xb.shape[-1] != image_size or xb.shape[-2] != image_size:
            xb = F.interpolate(
                xb, size=(image_size, image_size), mode="bilinear", align_corners=False
            )
        out.append(backbone(xb).float().to(x.device))
    return torch.cat(out) if out else torch.zeros(0, getattr(backbone, "num_features", 0))


def cached_features(
    x: torch.Tensor,
    *,
    name: str,
    weights: str | None,
    image_size: int,
    cache_dir: str | None = None,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """``extract_features`` with an on-disk cache keyed by inputs, backbone, weights and size.

    ``device`` is where the backbone runs (features are returned, and cached, on the CPU;
    a GPU's features differ from the CPU's by float rounding only, so the cache is shared)."""
    h = hashlib.sha256()
    h.update(x.detach().contiguous().numpy().tobytes())
    h.update(f"{name}|{image_size}|{_file_digest(weights) if weights else 'random'}".encode())
    root = Path(
        cache_dir
        or os.environ.get("FEDSGLD_CACHE", Path.home() / ".cache" / "fedsgld" / "features")
    )
    path = root / f"{h.hexdigest()[:24]}.pt"
    if path.is_file():
        return torch.load(path, weights_only=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)  # random backbones are the same in every process
        backbone = load_backbone(name, weights=weights, in_chans=x.shape[1])
    feats = extract_features(backbone.to(device), x.cpu(), image_size=image_size)
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(feats, tmp)
    os.replace(tmp, path)
    return feats
