"""Data: from sources to batches. Records and their checks, the raw snapshot format, the source
loaders that write snapshots, the token cache format with its builder and readers, the loaders that
draw batches from caches, and the parity artifacts written on the way. Not the tokenizers
(lockstep.tokenizer) and not a stage's paths and params (lockstep.pipeline).

- `records`: the record kinds (document, conversation, problem), their checks and conversions
- `snapshot`: the raw snapshot format: streaming parquet writer, checked readers, file bundles
- `sources`: the source loaders (`fetch@<source>`), one module per source, writing raw snapshots
- `encode`: documents to BOS-joined token arrays; the worker processes that encode for cache builds
- `cache`: the token cache format and its checked, memory-mapped readers
- `cache_build`: building caches: BOS-prefixed pretrain shards, SFT tokens + loss mask + offsets
- `loaders`: random windows, a rank-sharded resumable stream, masked SFT rows, mixtures
- `budget`: epochs per mixture component; the refusal above a stage's `max_epochs`
- `parity`: parity artifacts written while streaming: dataset snapshot, rendered samples, first batch
"""
