"""Export manifests: the schema, its JSON/msgpack files, and the cache a manifest builds.

m = load_manifest("manifests/sensenova-u1-8b-batched-16.json")   # validated, or ManifestError
cache = from_manifest(m, "cuda")                                  # a BatchedSequenceCache
dump_manifest(m, "copy.msgpack")                                  # same manifest, msgpack
"""

from batchkv.manifest.build import cache_config, from_manifest, make_manifest, window_pattern
from batchkv.manifest.codec import decode_manifest, dump_manifest, encode_json, encode_msgpack, load_manifest
from batchkv.manifest.schema import Layer, Manifest

__all__ = [
    "Layer",
    "Manifest",
    "cache_config",
    "decode_manifest",
    "dump_manifest",
    "encode_json",
    "encode_msgpack",
    "from_manifest",
    "load_manifest",
    "make_manifest",
    "window_pattern",
]
