"""Data: the built-in procedural city scene (`city_scene`), its on-disk cache (`city_cache`) and the nerfstudio
data parser that serves it (`city_dataparser`, registered as `odin-city`).

Import-light on purpose: the submodules pull numpy / torch / nerfstudio when they are imported, not this package.
"""
