"""Training: the shared loop of pretraining, midtraining and SFT, and what only training uses. It
does not know where batches come from or where a stage's files go (lockstep.pipeline.train).

- `trainer`: the `Trainer` (step, evaluate, state_dict, fit), its config, horizon and LR schedule
- `optim`: Muon (Newton-Schulz) for block matrices, fused AdamW for the rest; state sharded over ranks
- `objectives`: the training losses on logits (ce, prefix_smooth); `build` picks one from `<stage>.objective`
- `bpb`: bits per byte, the one measure behind training's val_bpb and eval's bpb.*
- `resume`: a run folder over ranks: its lock, rank-0 checkpoints, the checkpoint to resume from
"""
