"""Where the mathematics runs: ``cpu``, ``cuda`` or ``auto`` (cuda when a GPU is visible).

The device is a performance setting: it changes speed, never the method or its privacy.
Every random draw that matters keeps its explicit generator, made on the same device
(``fedsgld.core.noise.seeded_generator(..., device=...)``); a CUDA generator is a
different algorithm from the CPU's, so a seed gives different (equally reproducible)
numbers on a GPU than on the CPU.
"""

from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda", "auto")


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch device for a device setting.

    ``"cpu"`` and ``"cuda"`` (or ``"cuda:N"``) name a device, ``"auto"`` picks ``cuda`` when
    a GPU is visible and ``cpu`` otherwise. Asking for CUDA without a usable GPU raises
    ``ValueError`` rather than silently running on the CPU.
    """
    if isinstance(name, torch.device):
        dev = name
    else:
        if not isinstance(name, str):
            raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {name!r}")
        if name == "auto":
            return torch.device("cuda" if cuda_available() else "cpu")
        if name != "cpu" and name != "cuda" and not name.startswith("cuda:"):
            raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {name!r}")
        try:
            dev = torch.device(name)
        except RuntimeError as err:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {name!r}") from err
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {str(dev)!r}")
    if not cuda_available():
        raise ValueError(
            f"device={str(dev)!r} needs a CUDA GPU, but torch sees none on this machine "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); "
            "use device='cpu', or 'auto' to take a GPU only when there is one"
        )
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"device={str(dev)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return dev


def cuda_available() -> bool:
    """True when torch can run on a CUDA GPU here (False on CPU-only builds)."""
    try:
        return bool(torch.cuda.is_available())
    except Exception:  # a broken driver install reports itself as no GPU
        return False


def check_generator(generator: torch.Generator, device: torch.device, what: str) -> None:
    """Raise ValueError unless ``generator`` draws on ``device`` (type), naming ``what``."""
    if generator.device.type != device.type:
        raise ValueError(
            f"{what}: the generator draws on {generator.device.type} but the computation "
            f"runs on {device.type}; make the generator with "
            f"seeded_generator(..., device={device.type!r})"
        )
