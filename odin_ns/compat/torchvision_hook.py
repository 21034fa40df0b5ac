"""Let PyPI's torchvision import beside a CPU-only torch.

PyPI's torchvision wheels are CUDA builds: beside the CPU torch their `_C` extension cannot load (it links
`libtorch_cuda.so`). torchvision copes with that for its kernels (`_assert_has_ops` raises a clear error when one
is called), but its `_meta_registrations` module registers fake kernels for ops that were never declared, and the
import dies with `operator torchvision::nms does not exist`. nerfstudio imports torchvision at start-up (for
`torchvision.utils`), so nothing works.

This module declares the operator schemas (no kernels) right before torchvision is first imported, and only when
its extension did not load them. Calling such an op still fails loudly, as torchvision intends. Nothing else in
torchvision is touched. It is activated by a one-line `.pth` file (see `install_pth`) so that it runs before
nerfstudio's entry points, which import torchvision before any plugin code.
"""

from __future__ import annotations

import importlib.abc
import sys

# Schemas as torchvision declares them in csrc/ops/*.cpp (TORCH_LIBRARY_FRAGMENT(torchvision, m)).
_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "SymInt batch_size, SymInt channels, SymInt height, SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align(Tensor input, Tensor rois, float input_scale, int input_zero_point, float rois_scale, "
    "int rois_zero_point, float spatial_scale, SymInt pooled_height, SymInt pooled_width, int sampling_ratio, "
    "bool aligned) -> Tensor",
    "ps_roi_align(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
    "int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, int sampling_ratio, SymInt batch_size, SymInt channels, "
    "SymInt height, SymInt width) -> Tensor",
    "roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_roi_pool_backward(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, SymInt pooled_height, "
    "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, SymInt pooled_width) "
    "-> (Tensor, Tensor)",
    "_ps_roi_pool_backward(Tensor grad, Tensor rois, Tensor channel_mapping, float spatial_scale, "
    "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
    "SymInt width) -> Tensor",
    "deform_conv2d(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, SymInt stride_h, "
    "SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, SymInt groups, "
    "SymInt offset_groups, bool use_mask) -> Tensor",
    "_deform_conv2d_backward(Tensor grad, Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
    "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
    "SymInt groups, SymInt offset_groups, bool use_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)

_LIBRARY = None  # keeps the torch.library.Library alive (dropping it would undeclare the ops)


def declare_missing_ops() -> bool:
    """Declare the torchvision operator schemas that its extension did not declare. True if it declared any.

    A failed load of torchvision's extension can leave some schemas registered and not others, so each schema is
    checked on its own.
    """
    global _LIBRARY
    if _LIBRARY is not None or _extension_loads():
        return False
    missing = [s for s in _SCHEMAS if not _op_exists("torchvision::" + s.split("(", 1)[0])]
    if not missing:
        return False
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in missing:
        lib.define(schema)
    _LIBRARY = lib
    return True


def _op_exists(qualname: str) -> bool:
    import torch

    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
        return True
    except RuntimeError:
        return False


def _extension_loads() -> bool:
    """Try torchvision's own extension first: on a matching (CUDA) install the real kernels must win."""
    import importlib.util
    import os

    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    folder = list(spec.submodule_search_locations)[0]
    for name in os.listdir(folder):
        if name.startswith("_C") and name.endswith((".so", ".pyd")):
            try:
                torch.ops.load_library(os.path.join(folder, name))
                return True
            except (OSError, RuntimeError):
                return False
    return False


class _Finder(importlib.abc.MetaPathFinder):
    """Runs `declare_missing_ops` once, when `torchvision` is first imported, then steps aside."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: D102 (importlib protocol)
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        try:
            declare_missing_ops()
        except Exception as exc:  # never break an unrelated import; torchvision will report its own error
            print(f"odin_ns: could not prepare torchvision's operators: {exc}", file=sys.stderr)
        return None  # let the normal finders import torchvision


def install() -> None:
    if "torchvision" in sys.modules or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())


install()
