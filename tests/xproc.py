"""Run as a separate process: store or retrieve one context through LMCache
with the fx plugin, so tests can cross a process boundary."""

import json
import sys

import torch

from lmcache_fx.testing.cpu_engine import (
    KV,
    Geometry,
    config_from_dict,
    fx_backend,
    fx_config,
    lmcache_engine,
    retrieve,
    store_and_wait,
)


def main():
    role, store, workdir, ntok = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    geo = Geometry(layers=3, kv_heads=2, head_dim=64)
    cfg = config_from_dict(fx_config(store), workdir)
    tokens = torch.arange(ntok) % 5000
    kv = KV(geo, ntok, seed=7)
    with lmcache_engine(cfg, geo) as eng:
        be = fx_backend(eng)
        if role == "store":
            store_and_wait(eng, tokens, kv, be)
            out = {"chunks": len(be.store)}
        else:
            got = kv.empty_like()
            n = retrieve(eng, tokens, got)
            out = {"tokens": n, "equal": kv.tokens_equal(got, n), "chunks_read": be.store.stats.chunks_read}
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
