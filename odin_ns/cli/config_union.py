"""The odin methods as a tyro union, for the launchers' own parsing of `ns-train` arguments.

`ns-train`'s union (`nerfstudio.configs.method_configs.AnnotatedBaseConfigUnion`) imports and builds every
nerfstudio method and plugin: seconds in every rank at start-up. A rank, `odin-schedule` and the demo only ever
parse an odin method, so they build the same union, nerfstudio's way, over the three odin configs (the same
dataclasses, so the same options, defaults and saved config.yml as `ns-train`).
"""

from __future__ import annotations

from typing import List


def odin_config_union():
    import tyro

    from method_configs.odin_methods import METHODS

    return tyro.conf.SuppressFixed[tyro.conf.FlagConversionOff[tyro.extras.subcommand_type_from_defaults(
        defaults={name: spec.config for name, spec in METHODS.items()},
        descriptions={name: spec.description for name, spec in METHODS.items()})]]


def parse_odin_config(args: List[str], prog: str):
    """An odin method's TrainerConfig from `ns-train` arguments (METHOD first)."""
    import tyro

    return tyro.cli(odin_config_union(), args=args, prog=prog)
