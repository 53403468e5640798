"""Foundations: files, seeds, typed configs, the runtime and what a run records about itself, for
every other package. Knows nothing of models, data or training, and imports nothing of lockstep
outside this package.

- `io`: atomic writes, the one canonical JSON serialization, sha256 helpers, the error for a full disk
- `seeds`: every derived seed: hashed (`derive_seed`: training, RL) or arithmetic (`stream_seed`: data, eval)
- `config`: params mapping -> frozen dataclass; unknown keys, wrong types and bad values refused by name
- `runtime`: device and dtype chosen once with a reason; torchrun detection, one node or many; determinism
- `openmp`: OpenMP's wait policy (idle CPU threads sleep), set before torch loads
- `lifeline`: a stage's tie to the process that launched it (DVC, torchrun): it ends when that one dies
- `progress`: one progress line with fixed fields every few seconds for long data work
- `codeid`: a stage's code identity: the project files its entry module imports
- `runinfo`: run facts (times, throughput, device, commit, numerics), kept apart from metrics
- `fastpath`: fast paths that fall back to their reference path instead of ending a run, recorded
- `stats`: 95% intervals (Wilson, item bootstrap) and mean and spread across seeds
- `series`: per-step result series as TSV files, what `dvc plots` and the report draw
"""
