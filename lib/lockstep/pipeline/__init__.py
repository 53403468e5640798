"""Each stage's work: from a stage's typed config and explicit paths to its published outputs, run
facts and metrics. The only package that knows files and run folders; each `stages/X.py` imports
from its module here alone. Nothing here reads params.yaml or argv (the stages do).

- `fetch`: `fetch@<name>`: a source's params entry checked, its raw snapshot written and summarised
- `tokenizer`: the tokenizer stage: training text from the snapshots, a tokenizer trained and saved
- `cache`: `cache@<name>`: a raw snapshot and the tokenizer to a published token cache
- `train`: pretrain, midtrain and SFT around the Trainer: mixtures, model, run folder, outputs
- `live`: a training stage's latest step for DVC's tools while it runs (data/live/<stage>.json)
- `rl`: the rl stage: SFT checkpoint and problems in; RL checkpoint, metrics, series and run facts out
- `eval`: `eval@<stage>`: bits per byte, CORE and chat tasks; metrics and per-item records
- `report`: the report card (markdown and PNG charts) from metrics, run facts, eval records and series
"""
