"""World-to-camera matrices in gsplat's convention: splatfacto's `get_viewmat`, without its `torch.compile`.

splatfacto wraps the function in `torch.compile`, whose first call costs about 1.5 s of tracing in every process
(every rank at start-up, every `ns-eval`) for a 4x4 inverse that eager PyTorch does in microseconds. The same
operations, eagerly.
"""

from __future__ import annotations

import torch


def get_viewmat(camera_to_world: torch.Tensor) -> torch.Tensor:
    """[C, 4, 4] OpenCV world-to-camera from nerfstudio's [C, 3, 4] OpenGL camera-to-world."""
    R = camera_to_world[:, :3, :3]
    T = camera_to_world[:, :3, 3:4]
    R = R * torch.tensor([[[1, -1, -1]]], device=R.device, dtype=R.dtype)  # flip y and z (gsplat's axes)
    R_inv = R.transpose(1, 2)
    T_inv = -torch.bmm(R_inv, T)
    viewmat = torch.zeros(R.shape[0], 4, 4, device=R.device, dtype=R.dtype)
    viewmat[:, 3, 3] = 1.0
    viewmat[:, :3, :3] = R_inv
    viewmat[:, :3, 3:4] = T_inv
    return viewmat
