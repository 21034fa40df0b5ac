"""Data parser entry points (`nerfstudio.dataparser_configs`): `odin-data`, the default of the odin methods (the
built-in city without --data, else the layout found under --data), and `odin-city`, the built-in city block scene.

nerfstudio loads this while `nerfstudio.configs.dataparser_configs` is being imported, so nothing here may import
`nerfstudio.configs.dataparser_configs` / `method_configs` (directly or through a datamanager module).
"""

from nerfstudio.plugins.registry_dataparser import DataParserSpecification

from odin_ns.data.auto_dataparser import OdinAutoDataParserConfig
from odin_ns.data.city_dataparser import OdinCityDataParserConfig

odin_data = DataParserSpecification(
    config=OdinAutoDataParserConfig(),
    description="Default of the odin methods: the built-in city scene without --data; with --data, nerfstudio's "
    "parser for the layout found there (transforms.json, colmap sparse/0, blender)",
)

odin_city = DataParserSpecification(
    config=OdinCityDataParserConfig(),
    description="Built-in procedural city block (street-level and aerial views, each seeing a part; "
    "generated on first use and cached in $ODIN_NS_CACHE or ~/.cache/odin_ns)",
)
