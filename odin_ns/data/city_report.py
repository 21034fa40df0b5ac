"""Print what the built-in city looks like to the views: `python -m odin_ns.data.city_report [--blocks-x 6 ...]`.

Generates (or reuses) the cached dataset, then reports per view the fraction of the scene surface it sees
(area-weighted surface samples, exact occlusion) and of the seed points, the union coverage, and how many pairs
of views share nothing: the locality that primitive-level synchronization can exploit.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np

from odin_ns.data.city_cache import dataset_dir, ensure_city, load_city
from odin_ns.data.city_scene import CityConfig, build_city, make_cameras, surface_samples, visibility


def locality_stats(cfg: CityConfig, num_samples: int = 20000) -> dict:
    city = build_city(cfg)
    cams = make_cameras(cfg, city)
    samples = surface_samples(city, num_samples, seed=cfg.seed)
    vis = visibility(city, cams, samples)
    inter = (vis[:, None] & vis[None]).sum(-1)
    union = (vis[:, None] | vis[None]).sum(-1)
    iu = np.triu_indices(len(vis), 1)
    return {
        "kinds": list(cams.kind),
        "surface_fraction": vis.mean(axis=1),
        "union_coverage": float(vis.any(axis=0).mean()),
        "pairs_disjoint": float((inter[iu] == 0).mean()),
        "pair_jaccard_median": float(np.median(inter[iu] / np.maximum(union[iu], 1))),
        "num_samples": len(samples),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(CityConfig):
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default) if f.type != "bool" else int,
                        default=f.default)
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args(argv)
    cfg = CityConfig(**{f.name: (bool(getattr(args, f.name)) if isinstance(f.default, bool)
                                 else getattr(args, f.name)) for f in dataclasses.fields(CityConfig)})
    existed = dataset_dir(cfg, args.cache_dir).exists()
    t0 = time.perf_counter()
    folder = ensure_city(cfg, root=args.cache_dir)
    dt = time.perf_counter() - t0
    ds = load_city(folder)
    print(f"dataset {folder} ({'reused' if existed else f'generated in {dt:.1f}s'})")
    print(f"config {cfg.to_dict()}")
    print(f"{len(ds)} views of {ds.width}x{ds.height}, {len(ds.points_xyz)} seed points, "
          f"unit scale {ds.unit_scale:.5f} (1 unit = {1 / ds.unit_scale:.1f} m)")
    st = locality_stats(cfg)
    seed_frac = ds.visibility.mean(axis=1)
    print("view kind    surface  seed-points")
    for i, kind in enumerate(st["kinds"]):
        print(f"{i:4d} {kind:7s} {st['surface_fraction'][i]:7.3f} {seed_frac[i]:8.3f}")
    kinds = np.array(st["kinds"])
    for kind in ("street", "aerial"):
        f = st["surface_fraction"][kinds == kind]
        if len(f):
            print(f"{kind}: surface fraction min {f.min():.3f} median {np.median(f):.3f} max {f.max():.3f}")
    print(f"union coverage {st['union_coverage']:.3f} of {st['num_samples']} surface samples; "
          f"pairs of views sharing no surface {st['pairs_disjoint']:.2f}; "
          f"median pair Jaccard {st['pair_jaccard_median']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
