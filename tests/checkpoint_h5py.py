#!/usr/bin/env python3
"""Checks a meshtrain checkpoint with h5py, independently of the Rust reader.

Usage: checkpoint_h5py.py CKPT_DIR [NAME=FORMULA ...]

For every tensor in the index's own record (root attribute `tensors`): the virtual dataset has the
global shape; reading it whole equals the tensor assembled from the shard files read directly; each
shard's SHA-256 of its little-endian float32 bytes matches the record and the dataset's `sha256`
attribute. Optional NAME=FORMULA arguments check exact values: FORMULA is a Python expression of
the index tuple `i` (e.g. `model/w=i[0]*100+i[1]`). Run it from any directory: the virtual
datasets name their sources by relative paths. Exit status 0 means every check passed.
"""
import hashlib
import json
import os
import sys

import h5py
import numpy as np


def main():
    ckpt = sys.argv[1]
    formulas = dict(a.split("=", 1) for a in sys.argv[2:])
    with h5py.File(os.path.join(ckpt, "checkpoint.h5"), "r") as index:
        assert index.attrs["format"] == "meshtrain-checkpoint", index.attrs["format"]
        meta = json.loads(index.attrs["meta"])
        tensors = json.loads(index.attrs["tensors"])
        for t in tensors:
            name, shape = t["name"], tuple(t["global_shape"])
            whole = index[name][...]
            assert whole.shape == shape, (name, whole.shape, shape)
            assert whole.dtype == np.float32, (name, whole.dtype)
            assembled = np.full(shape, np.nan, dtype=np.float32)
            for s in t["shards"]:
                with h5py.File(os.path.join(ckpt, s["file"]), "r") as f:
                    ds = f[s["dataset"]]
                    data = ds[...]
                    assert list(data.shape) == s["shape"], (name, s)
                    digest = hashlib.sha256(data.astype("<f4").tobytes()).hexdigest()
                    assert digest == s["sha256"] == ds.attrs["sha256"], (name, s["dataset"])
                    assert list(ds.attrs["global_offset"]) == s["offset"], (name, s)
                    box = tuple(slice(o, o + n) for o, n in zip(s["offset"], s["shape"]))
                    assembled[box] = data
            assert not np.isnan(assembled).any(), f"{name}: shards do not cover the tensor"
            assert np.array_equal(whole, assembled), f"{name}: virtual dataset differs from its shards"
            if name in formulas:
                expect = np.fromfunction(lambda *i: eval(formulas[name], {"i": i}), shape)
                assert np.array_equal(whole, expect.astype(np.float32)), f"{name}: values differ from formula"
    print(f"h5py check OK: step {meta['step']}, {len(tensors)} tensors")


if __name__ == "__main__":
    main()
