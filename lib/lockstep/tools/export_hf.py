"""`lockstep export --to hf`: a checkpoint and its tokenizer written as a Hugging Face model folder
(safetensors weights, config.json, generation_config.json, tokenizer.json with its config and the
chat template, and the modelling code, lockstep.tools.hf_modeling, as `modeling_lockstep.py`),
which `transformers` loads with `trust_remote_code=True` and no lockstep installed. It needs
neither transformers nor the network: the files are written from lockstep's own objects. Not a
loader of such folders, and not a converter back.

Tokenizers that export: `bpe` (its tiktoken ranks turned into BPE merges, see `bpe_merges`),
`hf` (its own tokenizer.json), `byte` and `char` (one id per byte). `lz78` and `sentencepiece`
are refused (ExportError): no `tokenizers` model encodes as they do."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import save as safetensors_save

from lockstep.core.io import atomic_dir, sha256_file, write_json
from lockstep.model.checkpoint import load_model
from lockstep.model.gpt import GPT
from lockstep.tokenizer import SPECIAL_TOKENS, Tokenizer, load_tokenizer
from lockstep.tokenizer.hf import TOKENIZER_FILE, to_byte_level

EXPORTABLE_KINDS = ("bpe", "hf", "byte", "char")
MODELING_FILE = "modeling_lockstep.py"  # the name auto_map points at
EXPORT_FILE = "lockstep_export.json"  # where the folder came from, and the sha256 of every file
# What ends a reply, as lockstep.infer.engine.Engine.STOP_TOKENS: generation stops on either.
STOP_TOKENS = ("<|assistant_end|>", "<|bos|>")

# lockstep's chat format (lockstep.tokenizer.base.Tokenizer.render_conversation) as a Jinja
# template: one <|bos|>, a leading system message folded into the first user message after a
# blank line, roles alternating user/assistant, an assistant's content a string or typed parts
# (text, python, python_output), and `add_generation_prompt` opening the assistant's turn.
CHAT_TEMPLATE = r"""{%- macro text_of(content) -%}
{%- if content is string -%}{{ content }}
{%- else -%}{%- for part in content -%}{{ part['text'] }}{%- endfor -%}{%- endif -%}
{%- endmacro -%}
{%- set ns = namespace(system=none, start=0) -%}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- if messages | length == 1 -%}
{{ raise_exception('a system message must be followed by a user message') }}
{%- endif -%}
{%- set ns.system = text_of(messages[0]['content']) -%}{%- set ns.start = 1 -%}
{%- endif -%}
<|bos|>
{%- for message in messages[ns.start:] -%}
{%- set expected = 'user' if loop.index0 % 2 == 0 else 'assistant' -%}
{%- if message['role'] != expected -%}
{{ raise_exception('after an optional leading system message, roles must alternate user, assistant, user, ...') }}
{%- endif -%}
{%- if message['role'] == 'user' -%}
<|user_start|>
{%- if loop.first and ns.system is not none -%}{{ ns.system }}{{ '\n\n' }}{%- endif -%}
{{ text_of(message['content']) }}<|user_end|>
{%- else -%}
<|assistant_start|>
{%- if message['content'] is string -%}{{ message['content'] }}{%- else -%}
{%- for part in message['content'] -%}
{%- if part.get('type', 'text') == 'python' -%}<|python_start|>{{ part['text'] }}<|python_end|>
{%- elif part.get('type', 'text') == 'python_output' -%}<|output_start|>{{ part['text'] }}<|output_end|>
{%- else -%}{{ part['text'] }}{%- endif -%}
{%- endfor -%}
{%- endif -%}
<|assistant_end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant_start|>{%- endif -%}"""


class ExportError(ValueError):
    """What is asked cannot be exported; the message says what can."""


def bpe_merges(pieces: Sequence[bytes | None]) -> list[tuple[bytes, bytes]]:
    """BPE merges that encode as tiktoken does over the ranks `pieces` (id -> bytes, None for a
    special). tiktoken merges, of all adjacent pairs, the one whose concatenation has the lowest
    rank, whichever split made it; a `tokenizers` BPE merges the pair listed first. So every split
    of every token into two tokens is listed, ordered by the token's rank (then by the ranks of
    its two parts), which makes "listed first" "lowest rank". The two can differ only where two
    different splits of one token overlap in a word (`a|aa|a`, both sides spelling `aaa`): tiktoken
    takes the leftmost, `tokenizers` the split listed first."""
    rank = {p: i for i, p in enumerate(pieces) if p is not None}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, r in rank.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in rank and right in rank:
                merges.append((r, rank[left], rank[right], left, right))
    return [(left, right) for *_, left, right in sorted(merges)]


def hf_tokenizer(tok: Tokenizer, tokenizer_dir: Path) -> Any:
    """A `tokenizers.Tokenizer` that gives `tok`'s ids (ordinary text and the special tokens),
    with a post-processor that prepends <|bos|> when special tokens are asked for."""
    import tokenizers as hf
    from tokenizers import pre_tokenizers as pre

    if tok.kind not in EXPORTABLE_KINDS:
        raise ExportError(
            f"a {tok.kind} tokenizer does not export to Hugging Face: no `tokenizers` model encodes "
            f"as it does. Kinds that export: {', '.join(EXPORTABLE_KINDS)} (tokenizer.kind); "
            "lz78 and sentencepiece are refused"
        )
    if not tok.has_special_tokens:
        raise ExportError(
            f"this {tok.kind} tokenizer has no special tokens, so no <|bos|> and no chat template to "
            "export; rebuild it with them (tokenizer.options.specials: true)"
        )
    if tok.kind == "hf":
        # The kind's own file, as lockstep encodes with it (its merges, not ones rebuilt from ranks).
        out = hf.Tokenizer.from_file(str(tokenizer_dir / TOKENIZER_FILE))
    else:
        pieces = tok.token_pieces()
        vocab = {to_byte_level(p): i for i, p in enumerate(pieces) if p is not None}
        if tok.kind == "bpe":
            merges = [(to_byte_level(a), to_byte_level(b)) for a, b in bpe_merges(pieces)]
            # tiktoken takes a chunk that is itself a token whole, before any merge
            out = hf.Tokenizer(hf.models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
            out.pre_tokenizer = pre.Sequence(
                [
                    pre.Split(hf.Regex(tok.pattern), behavior="isolated"),
                    pre.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        else:  # byte, char: one id per byte; char's bytes outside its alphabet read as its id 0
            unk = {"unk_token": to_byte_level(pieces[0])} if tok.kind == "char" else {}
            out = hf.Tokenizer(hf.models.BPE(vocab=vocab, merges=[], **unk))
            out.pre_tokenizer = pre.ByteLevel(add_prefix_space=False, use_regex=False)
        out.decoder = hf.decoders.ByteLevel()
        out.add_special_tokens([hf.AddedToken(name, special=True, normalized=False) for name in SPECIAL_TOKENS])
    specials = tok.get_special_tokens()
    added = {name: out.token_to_id(name) for name in SPECIAL_TOKENS}
    assert added == specials, (added, specials)
    bos = SPECIAL_TOKENS[0]
    out.post_processor = hf.processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, specials[bos])]
    )
    return out


def hf_config(model: GPT, tok: Tokenizer) -> dict[str, Any]:
    """config.json: the model's shape under transformers' names, and where its code is."""
    c = model.config
    sp = tok.get_special_tokens()
    return {
        "architectures": ["LockstepForCausalLM"],
        "model_type": "lockstep",
        "auto_map": {
            "AutoConfig": f"{MODELING_FILE[:-3]}.LockstepConfig",
            "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.LockstepForCausalLM",
        },
        "vocab_size": c.vocab_size,
        "padded_vocab_size": c.padded_vocab_size,
        "hidden_size": c.n_embd,
        "num_hidden_layers": c.n_layer,
        "num_attention_heads": c.n_head,
        "num_key_value_heads": c.n_kv_head,
        "intermediate_size": c.mlp_ratio * c.n_embd,
        "max_position_embeddings": c.sequence_len,
        "rope_theta": c.rope_theta,
        "logit_softcap": c.softcap,
        "rms_norm_eps": 1e-6,  # lockstep.model.ops.RMS_EPS
        "embedding": c.embedding,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": sp["<|bos|>"],
        "eos_token_id": [sp[name] for name in STOP_TOKENS],
        "pad_token_id": sp["<|assistant_end|>"],
        "dtype": "float32",
    }


def hf_weights(model: GPT) -> dict[str, Any]:
    """The model's state dict under the names LockstepForCausalLM holds them by: the embedding's
    top-level keys (`wte.weight`, `token_parent_row`, ...) under `model.embed.`, the blocks under
    `model.`, the head as it is."""
    out = {}
    for key, value in model.state_dict().items():
        if key.startswith("lm_head."):
            name = key
        elif key.startswith("blocks."):
            name = "model." + key
        else:
            name = "model.embed." + key
        out[name] = value.detach().to("cpu").contiguous()
    return out


def model_card(meta: dict[str, Any], tok: Tokenizer, model: GPT) -> str:
    c = model.config
    return f"""---
library_name: transformers
tags: [lockstep]
---
# A lockstep GPT

Trained with lockstep and exported with `lockstep export --to hf`: {c.n_layer} layers, width
{c.n_embd}, {c.n_head} query and {c.n_kv_head} key/value heads, a context of {c.sequence_len}
tokens, a {tok.kind} tokenizer of {tok.get_vocab_size()} ids, `{c.embedding}` token embedding;
checkpoint step {meta.get("step")}. The architecture (ReLU^2 MLP, QK-norm, rotary positions,
soft-capped untied head) is lockstep's own, in `{MODELING_FILE}`:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(FOLDER, trust_remote_code=True)
tok = AutoTokenizer.from_pretrained(FOLDER)
ids = tok.apply_chat_template([{{"role": "user", "content": "Who are you?"}}], add_generation_prompt=True,
                              return_tensors="pt", return_dict=True)
out = model.generate(**ids, max_new_tokens=64)
print(tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True))
```

Generation stops at `<|assistant_end|>` or `<|bos|>`. lockstep's calculator tool is not run by
`generate`: a reply that calls it (`<|python_start|>...<|python_end|>`) gets no result.
"""


def export_hf(
    ckpt_dir: str | os.PathLike[str], tokenizer_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str]
) -> dict[str, str]:
    """Write the checkpoint at `ckpt_dir` (verified, and refused unless it was trained with the
    tokenizer at `tokenizer_dir`) as a Hugging Face model folder at `out_dir`, replaced whole and
    atomically. An existing `out_dir` must be an earlier export (its lockstep_export.json) or
    empty. Returns the written files' sha256 by name. ExportError (a ValueError) says what to fix;
    the checkpoint's and the tokenizer's loaders raise their own (also ValueErrors)."""
    ckpt_dir, tokenizer_dir, out_dir = Path(ckpt_dir), Path(tokenizer_dir), Path(out_dir)
    if out_dir.exists() and not (out_dir / EXPORT_FILE).is_file() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ExportError(
            f"{out_dir} exists and is not an earlier export (no {EXPORT_FILE}); export to a new or "
            "empty folder, or delete it first"
        )
    tok = load_tokenizer(tokenizer_dir)
    tokenizer = hf_tokenizer(tok, tokenizer_dir)  # refuses a kind that does not export, before the weights load
    model, meta = load_model(ckpt_dir, "cpu", tokenizer_sha256=tok.sha256)
    sp = tok.get_special_tokens()
    tokenizer_config = {
        # transformers' fast tokenizer over tokenizer.json (TokenizersBackend in transformers 5)
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|assistant_end|>",
        "pad_token": "<|assistant_end|>",
        "padding_side": "left",  # generate continues every row from its last token
        "model_max_length": model.config.sequence_len,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": True,
    }
    generation_config = {
        "bos_token_id": sp["<|bos|>"],
        "eos_token_id": [sp[n] for n in STOP_TOKENS],
        "pad_token_id": sp["<|assistant_end|>"],
        "do_sample": False,
    }
    modeling = (Path(__file__).with_name("hf_modeling.py")).read_bytes()
    with atomic_dir(out_dir) as tmp:
        (tmp / "model.safetensors").write_bytes(safetensors_save(hf_weights(model), metadata={"format": "pt"}))
        (tmp / "config.json").write_text(json.dumps(hf_config(model, tok), indent=2) + "\n", encoding="utf-8")
        write_json(tmp / "generation_config.json", generation_config)
        (tmp / "tokenizer.json").write_text(tokenizer.to_str(pretty=False) + "\n", encoding="utf-8")
        write_json(tmp / "tokenizer_config.json", tokenizer_config)
        (tmp / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
        (tmp / MODELING_FILE).write_bytes(modeling)
        (tmp / "README.md").write_text(model_card(meta, tok, model), encoding="utf-8")
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir())}
        write_json(
            tmp / EXPORT_FILE,
            {
                "checkpoint": str(ckpt_dir),
                "step": meta.get("step"),
                "tokenizer_kind": tok.kind,
                "tokenizer_sha256": tok.sha256,
                "code_revision": meta.get("code_revision"),
                "files": files,
            },
        )
    return files
