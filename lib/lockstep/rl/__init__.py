"""Reinforcement learning on the model's own samples. Not a general RL library, and not the rl
stage's files (lockstep.pipeline.rl). Each module imports only those listed above it.

- `rollouts`: the `Completion` record, a step's `Rollouts`, the tool-call reading that scores them
- `strategies`: how a group is scored, by name: ADVANTAGES, GREEDY_ROLLOUTS, REFERENCE_ROLLOUTS, CREDIT
- `config`: the `rl` params section, RLConfig, its names checked against the strategy tables
- `losses`: an update's gradients: the policy loss (a group's prompt once) and the anchor's loss
- `trainer`: GRPO-style policy gradient as RLTrainer (rollout, update, evaluate, fit), pass@k, the problem draw
"""
