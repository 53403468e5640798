"""The README's two prompts asked first and asked second, through the chat backend that
`lockstep chat` and `lockstep serve` use (calculator tool on): does a reply stay right when a
conversation already holds one exchange? Greedy once and at temperature 0.6 over `--samples`
seeds per case, on each checkpoint given.

    PYTHONPATH=lib .venv/bin/python bench/chat_second_turn.py data/ckpt/sft data/ckpt/rl

A reply to "Who are you?" is right when it names lockstep; one to the strawberry question when it
says the letter appears 3 times. Asked second, the first exchange is the model's own greedy reply
to the other prompt."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from lockstep.infer.chat import SamplingSettings, load_backend

WHO = "Who are you?"
STRAWBERRY = "How many times does the letter 'r' appear in 'strawberry'?"
RIGHT = {WHO: lambda reply: "lockstep" in reply.lower(),
         STRAWBERRY: lambda reply: bool(re.search(r"\b3 times\b", reply))}


def reply(backend, messages: list[dict], temperature: float, seed: int) -> str:
    settings = SamplingSettings(temperature=temperature, seed=seed, max_tokens=160)
    return "".join(delta.text for delta in backend.stream(messages, settings))


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def measure(backend, samples: int) -> dict[str, dict[str, float]]:
    """{case: {"greedy": 0/1, "t0.6": share right}} for each prompt asked first and second."""
    first_replies = {p: reply(backend, [user(p)], 0.0, 0) for p in (WHO, STRAWBERRY)}
    out = {}
    for prompt, other in ((WHO, STRAWBERRY), (STRAWBERRY, WHO)):
        for where, history in (("first", []), ("second", [user(other), {"role": "assistant",
                                                                       "content": first_replies[other]}])):
            messages = [*history, user(prompt)]
            greedy = reply(backend, messages, 0.0, 0)
            sampled = [reply(backend, messages, 0.6, seed) for seed in range(samples)]
            out[f"{'who' if prompt == WHO else 'strawberry'} asked {where}"] = {
                "greedy": float(RIGHT[prompt](greedy)),
                "t0.6": sum(RIGHT[prompt](r) for r in sampled) / samples,
                "greedy_reply": greedy,
            }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpts", nargs="+", type=Path, help="checkpoint folders (data/ckpt/sft, data/ckpt/rl)")
    ap.add_argument("--tokenizer", type=Path, default=Path("data/tokenizer"))
    ap.add_argument("--samples", type=int, default=20, help="seeds per case at temperature 0.6")
    args = ap.parse_args()
    for ckpt in args.ckpts:
        result = measure(load_backend(ckpt, args.tokenizer), args.samples)
        print(f"== {ckpt}")
        for case, r in result.items():
            print(f"{case:24s} greedy {'right' if r['greedy'] else 'wrong':5s}  t=0.6 {r['t0.6']:.2f} "
                  f"of {args.samples}  | {json.dumps(r['greedy_reply'][:90])}")


if __name__ == "__main__":
    main()
