"""The renderer's benchmark of the two halves (`python -m odin_ns.render.bench --halves`): what it times is what it
says, a view's splats in its image, and the Gaussians `--outside` moves out of the image are all culled."""

import torch

from odin_ns.render.bench import main, make_scene
from odin_ns.render.projection import RowCameras
from odin_ns.render.splats import project_splats


def test_the_halves_count_the_splats_in_the_image_and_the_moved_gaussians_leave_it():
    threads = torch.get_num_threads()
    try:
        (inside,) = main(["--halves", "--sizes", "3000x64x48", "--repeats", "1", "--threads", "1"])
        (half,) = main(["--halves", "--sizes", "3000x64x48", "--repeats", "1", "--threads", "1", "--outside", "0.5"])
    finally:
        torch.set_num_threads(threads)
    s = make_scene(3000, 64, 48)
    ids, _, _ = project_splats(s["means"], s["quats"], s["scales"].log(), torch.logit(s["opacities"])[:, None],
                               s["colors"], RowCameras.one(s["viewmats"][0], s["Ks"][0], 64, 48), 3, False)
    assert inside["visible"] == ids.numel() > 0.9 * 3000
    assert half["visible"] == int((ids >= 1500).sum())  # the first half moved out, every one of them culled
    assert min(inside["owner_s"], inside["reader_s"], half["owner_s"], half["reader_s"]) > 0
