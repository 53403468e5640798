"""The model: the GPT as a reference, the primitives it is written in with their fast paths, its
token embeddings, and checkpoints, the one way a checkpoint becomes a GPT. Not a training loop
(lockstep.train) and not a decoder (lockstep.infer).

- `gpt`: the GPT: one config, one module (RoPE, QK-norm, GQA, ReLU^2, soft-capped head)
- `ops`: the model's primitives (norm, head, soft cap, losses) and the `Ops` switch between their paths
- `embeddings`: token embeddings, one class per `model.embedding` kind: flat, structured, tuple, hierarchical
- `kernels`: CPU fast paths of the primitives (`runtime.kernels`), held equal to the reference by tests
- `checkpoint`: checkpoint folders: safetensors, per-rank optimizer state, meta.json, manifest; `load_model`
"""
