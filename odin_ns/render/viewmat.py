"""World-to-camera matrices in gsplat's convention: splatfacto's `get_viewmat`, without its `torch.compile`, and a
training camera's (viewmat, K, W, H) at a render resolution (`view_projection`).

splatfacto wraps the function in `torch.compile`, whose first call costs about 1.5 s of tracing in every process
(every rank at start-up, every `ns-eval`) for a 4x4 inverse that eager PyTorch does in microseconds. The same
operations, eagerly.
"""

from __future__ import annotations

from typing import Tuple

import torch
from nerfstudio.cameras.cameras import Cameras


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


def view_projection(camera: Cameras, downscale: int) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
    """(viewmat [1,4,4] OpenCV world-to-camera, K [1,3,3], W, H) of one camera at the model's render resolution."""
    cam = camera.to("cpu")
    cam = Cameras(camera_to_worlds=cam.camera_to_worlds.clone(), fx=cam.fx.clone(), fy=cam.fy.clone(),
                  cx=cam.cx.clone(), cy=cam.cy.clone(), width=cam.width.clone(), height=cam.height.clone(),
                  camera_type=cam.camera_type.clone())
    cam.rescale_output_resolution(1 / downscale)
    width, height = int(cam.width.item()), int(cam.height.item())
    return get_viewmat(cam.camera_to_worlds), cam.get_intrinsics_matrices(), width, height
