"""Front doors: what people call through the `lockstep` command, before or after a run. No stage
imports them.

- `presets`: presets/NAME.yaml -> params.yaml (`lockstep preset`)
- `plan`: `lockstep plan`: params, FLOPs, tokens, epochs, disk, memory and wall time, before anything runs
- `parity_diff`: `lockstep parity`: the first difference between two runs' parity artifacts
- `exp_summary`: `lockstep exp summary`: DVC experiments grouped by params, metrics across seeds
- `export_hf`: `lockstep export --to hf`: a checkpoint and its tokenizer as a Hugging Face model folder
- `hf_modeling`: the transformers config and causal-LM classes that an exported folder ships (no lockstep import)
"""
