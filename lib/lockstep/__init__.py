"""lockstep: train a chat model from scratch as a DAG of reproducible stages; import the module
you need. Its packages are the library's layers, top to bottom: each imports from itself and the
ones above it only (the one exception, and each module's row, in docs/internals.md's "Module
map"). A package's `__init__` holds its docstring and no code, but for this root, `tokenizer`
(which registers every kind), `tokenizer.lz78` (that kind's tokenizer) and `data.sources` (the
source registry and `fetch_source`). The root does one thing at import: it sets OpenMP's wait
policy (lockstep.core.openmp), which torch's CPU threads read once, when torch loads, so that a
script or notebook that imports lockstep before torch trains beside other work as a stage does.

- `core`: foundations: files, seeds, typed configs, the runtime, run facts; nothing of models or data
- `tokenizer`: one tokenizer interface over six kinds and the chat template; reads no snapshots
- `data`: from sources to batches: records, raw snapshots, source loaders, token caches, loaders
- `model`: the GPT, its primitives, embeddings and CPU kernels, and checkpoints; no training
- `train`: the training loop and what only it uses: optimizers, objectives, bits per byte, resume
- `infer`: decoding and chat: sampling rules, the KV-cache engine, the calculator, chat and server
- `evaluate`: CORE and chat tasks and the code sandbox; no stage wiring
- `rl`: the policy-gradient loop on the model's own samples
- `pipeline`: each stage's work, and the only package that knows files and run folders
- `dev`: tools for working on lockstep, imported by no stage
- `tools`: front doors: presets, the cost plan, parity and seed-sweep summaries
- `cli`: the `lockstep` console script
"""

from lockstep.core.openmp import choose_wait_policy as _choose_wait_policy

_choose_wait_policy()
