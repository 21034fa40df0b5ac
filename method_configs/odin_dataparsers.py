"""Data parser entry points (`nerfstudio.dataparser_configs`): `odin-city`, the built-in city block scene.

nerfstudio loads this while `nerfstudio.configs.dataparser_configs` is being imported, so nothing here may import
`nerfstudio.configs.dataparser_configs` / `method_configs` (directly or through a datamanager module).
"""

from nerfstudio.plugins.registry_dataparser import DataParserSpecification

from odin_ns.data.city_dataparser import OdinCityDataParserConfig

odin_city = DataParserSpecification(
    config=OdinCityDataParserConfig(),
    description="Built-in procedural city block (street-level and aerial views, each seeing a part; "
    "generated on first use and cached in $ODIN_NS_CACHE or ~/.cache/odin_ns)",
)
