"""Reinforcement learning on the model's own samples. Not a general RL library, and not the rl
stage's files (lockstep.pipeline.rl).

- `loop`: GRPO-style policy gradient on GSM8K-format problems: records, strategy tables, RLTrainer
"""
