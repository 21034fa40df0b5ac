"""Odin for nerfstudio: distributed 3D Gaussian splatting with primitive-level synchronization.

Kept import-free on purpose: `odin_ns.compat.torchvision_hook` is imported at interpreter start (through a
`.pth` file on CPU-only installs) and must not pull torch in by itself.
"""

__version__ = "0.1.0"
