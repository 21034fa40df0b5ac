"""nerfstudio registrations of the odin methods and data parser (entry points in pyproject.toml).

These modules are imported during nerfstudio's own config discovery: they must not import
`nerfstudio.configs.method_configs` or `nerfstudio.configs.dataparser_configs` (circular import).
"""
