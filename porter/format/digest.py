"""The chunk hashes of porter's shard digests, by the name `porter convert --digest` and porter.json use
(docs/artifact-format.md, "Digests"): the one table the CLI's choices, porter.format.safetensors_io's digest
rule and verify's reading of it all come from."""

import hashlib

import xxhash

# name -> the chunk hash. The tensor and shard roots are sha256 for both: they hash a few digests, not data.
# xxh3-128 is the default: a fraction of sha256's CPU cost (docs/artifact-format.md), the checksum
# rsync uses for files since 3.2; sha256 is for a manifest that is signed or published apart from the shards
# (a collision can be built for xxh3, not for sha256).
CHUNK_HASHES = {"xxh3-128": xxhash.xxh3_128, "sha256": hashlib.sha256}
DEFAULT_DIGEST = "xxh3-128"
CHUNK_HASH_DOC = {
    "xxh3-128": "16-byte XXH3-128 (seed 0, canonical big-endian) digests",
    "sha256": "32-byte sha256 digests",
}
