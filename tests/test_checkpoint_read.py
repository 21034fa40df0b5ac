"""Reading a checkpoint to resume (`checkpoint._read`): a plain splatfacto checkpoint, whose schedulers leave
numpy's float64 learning rates, is read (torch's safe loading refuses numpy objects unless allowed), its tensors
mapped from the file; a file that is not a checkpoint is reported, not raised."""

import numpy as np
import torch

from odin_ns.checkpoint import _read


def test_a_plain_splatfacto_checkpoint_is_read_and_a_file_that_is_none_is_reported(tmp_path):
    path = tmp_path / "step-000000009.ckpt"
    torch.save({"step": 9, "pipeline": {"_model.gauss_params.means": torch.arange(6.0).reshape(2, 3)},
                "schedulers": {"means": {"base_lrs": [np.float64(1.6e-4)], "_last_lr": [np.float64(1.5e-4)]}}}, path)
    state = _read(path)
    assert isinstance(state, dict), state
    assert state["schedulers"]["means"]["_last_lr"] == [1.5e-4]
    assert torch.equal(state["pipeline"]["_model.gauss_params.means"], torch.arange(6.0).reshape(2, 3))
    garbage = tmp_path / "step-000000010.ckpt"
    garbage.write_bytes(b"not a checkpoint" * 8)
    assert isinstance(_read(garbage), Exception)
    cut = tmp_path / "step-000000011.ckpt"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert isinstance(_read(cut), Exception)
