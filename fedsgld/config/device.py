"""The device setting resolved: ``cpu``, ``cuda`` or ``auto`` (cuda when a GPU is visible)
turned into the ``torch.device`` a run computes on.

The device is a performance setting: it changes speed, never the method or its privacy.
This is the only part of :mod:`fedsgld.config` that imports torch; it is imported when a
run asks for its device (:meth:`fedsgld.config.PerfSettings.torch_device`), never by the
command-line help.
"""

from __future__ import annotations

import torch

from fedsgld.config.checks import DEVICES


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
