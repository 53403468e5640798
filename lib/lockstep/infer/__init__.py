"""Inference: sampling a model's replies and the people-facing ends of it. Sampling rules, the
KV-cache engine and its static-shape fast path, the calculator tool, the chat session and what of
it fits the context, and the HTTP server with its connection guard and web UI (`static/`). Knows
no training and no stage.

- `sampling`: sampling defaults, limits, the greedy rule and the top_p floor, shared by every front end
- `engine`: KV cache, batched sampling and batched greedy replies, calculator output forced in
- `cpu_step`: the reference engine's CPU decode step: fused q/k/v, fp32 products, a prepacked head
- `decode`: the engine's fast path: static KV cache, device-side step and sampler, CUDA-graph capture
- `calculator`: the model's tool: allowlist arithmetic over the parsed syntax tree (never eval)
- `chat`: the chat backend (messages in, text deltas out) and the terminal chat
- `context`: which turns of a conversation fit the model's context, shared by the terminal chat and the API
- `server`: the FastAPI app: an OpenAI-style API and the single-page web UI
- `serving`: `lockstep serve`'s connections: header and body deadlines, a cap, bounded error logs
"""
