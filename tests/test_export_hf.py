"""`lockstep export --to hf` against lockstep itself: the folder loads in `transformers` offline
(the model with trust_remote_code, the tokenizer without), with no lockstep importable; its fp32
logits equal the GPT's and its greedy `generate` gives the Engine's greedy tokens, one prompt or
a left-padded batch; its tokenizer gives lockstep's ids, special tokens included, and its chat
template lockstep's chat rendering; the kinds that do not export are refused, saying which do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from _text_corpus import CORPUS
from _tiny_model import randomize, tiny_config
from lockstep.cli import app as cli_app
from lockstep.data.sources.shakespeare import plays_dir, split_scenes
from lockstep.infer.engine import Engine
from lockstep.model.checkpoint import save_checkpoint
from lockstep.model.gpt import GPT
from lockstep.tokenizer import load_tokenizer
from lockstep.tokenizer.char import CharTokenizer
from lockstep.tokenizer.kinds import train_tokenizer
from lockstep.tools.export_hf import EXPORT_FILE, ExportError, export_hf, hf_tokenizer

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed: install the `hf` extra (pip install -e '.[hf]')"
)

ROOT = Path(__file__).resolve().parents[1]
# (tokenizer kind, model.embedding): every embedding kind, hierarchical reading the prefix tree's
# parents (only lz78, which does not export, has parents of its own).
CASES = [("bpe", "flat"), ("bpe", "tuple"), ("byte", "structured"), ("hf", "hierarchical")]
TEXTS = [
    "To be, or not to be, that is the question: 12345 + 678 = 13023\n",
    "Héllo wörld — ünïcödé, emoji 🙂 and CJK 漢字.\r\n\tdef f(x):\n    return x ** 2\n",
    "  leading spaces, trailing ones   \n\n\nand 'quotes' it's they're\u3000\u00a0",
]
CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "Who are you?"}]},
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "A small model."},
            {"role": "user", "content": "\n  And? \t\n"},
        ]
    },
    {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "How many r's "}, {"type": "text", "text": "in strawberry?"}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me count: "},
                    {"type": "python", "text": "'strawberry'.count('r')"},
                    {"type": "python_output", "text": "3"},
                    {"type": "text", "text": " so 3."},
                ],
            },
        ]
    },
]


def make_checkpoint(folder: Path, kind: str, embedding: str = "flat", seed: int = 0) -> tuple[GPT, object]:
    """A tokenizer of `kind` in folder/tokenizer and a random two-layer GQA GPT over it with
    `embedding` (its token structure set) as the checkpoint folder/ckpt."""
    vocab_size = 400 if kind in ("bpe", "hf", "lz78", "sentencepiece") else None
    extra = {"sentencepiece": {"model_type": "bpe", "seed": 0}, "lz78": {"fast": False}}.get(kind, {})
    tok = train_tokenizer(kind, CORPUS, vocab_size=vocab_size, **extra)
    tok.save(folder / "tokenizer")
    config = tiny_config(
        vocab_size=tok.get_vocab_size(), embedding=embedding, n_layer=2, n_head=4, n_kv_head=2, sequence_len=96
    )
    model = randomize(GPT.build(config, "cpu"), seed=seed)
    if embedding != "flat":
        model.embed.set_token_structure(*tok.token_structure("prefix"))
    save_checkpoint(
        folder / "ckpt",
        model.state_dict(),
        {0: {}},
        {"step": 7, "model_config": config.to_dict(), "tokenizer_sha256": tok.sha256},
    )
    return model.eval(), tok


@pytest.fixture(scope="module", autouse=True)
def _modules_cache(tmp_path_factory):
    """transformers imports a folder's modelling code from a copy in its modules cache (under
    ~/.cache by default): a temp folder here, and sys.path, which it appends that folder to, restored."""
    import transformers.dynamic_module_utils as dynamic

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path_factory.mktemp("hf_modules")))
        mp.setattr(sys, "path", list(sys.path))
        yield


@pytest.fixture(scope="module", params=CASES, ids=[f"{k}-{e}" for k, e in CASES])
def exported(request, tmp_path_factory):
    """(lockstep GPT, lockstep tokenizer, HF model, HF tokenizer, folder) of one case."""
    kind, embedding = request.param
    folder = tmp_path_factory.mktemp(f"{kind}-{embedding}")
    model, tok = make_checkpoint(folder, kind, embedding)
    export_hf(folder / "ckpt", folder / "tokenizer", folder / "hf")
    hf_model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder / "hf", trust_remote_code=True, output_loading_info=True
    )
    assert not any(info.values()), info  # every weight and buffer read, none left over or reinitialised
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder / "hf", trust_remote_code=False)
    return model, tok, hf_model.eval(), hf_tok, folder / "hf"


def test_logits_equal_lockstep_in_fp32(exported) -> None:
    model, tok, hf_model, _, _ = exported
    ids = torch.tensor(tok.encode(TEXTS, prepend="<|bos|>")[1][:80])[None]  # (1, T)
    with torch.no_grad():
        ours, theirs = model(ids), hf_model(ids).logits
    assert theirs.dtype == torch.float32 and theirs.shape == ours.shape == (1, ids.size(1), tok.get_vocab_size())
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    # and the loss transformers' causal LMs compute: each position against the next label
    with torch.no_grad():
        loss = hf_model(ids, labels=ids).loss
    torch.testing.assert_close(loss, model(ids[:, :-1], targets=ids[:, 1:]), rtol=0, atol=1e-5)


def test_greedy_generate_equals_the_engine(exported) -> None:
    model, tok, hf_model, _, _ = exported
    engine = Engine(model, tok)
    for conversation in CONVERSATIONS[:2]:
        prompt = tok.render_for_completion(conversation)
        ours = [column[0] for column, _ in engine.generate(prompt, max_tokens=24, temperature=0.0, use_tools=False)]
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
        assert out[0, len(prompt) :].tolist() == ours


def test_left_padded_batch_generates_each_prompt_as_alone(exported) -> None:
    model, tok, hf_model, hf_tok, _ = exported
    messages = [c["messages"] for c in CONVERSATIONS[:2]]
    batch = hf_tok.apply_chat_template(
        messages, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )
    assert batch["attention_mask"].min() == 0  # the prompts differ in length, so one row is padded
    out = hf_model.generate(**batch, max_new_tokens=12, do_sample=False)
    ours = Engine(model, tok).generate_greedy(
        [tok.render_for_completion(c) for c in CONVERSATIONS[:2]], max_tokens=12, batch_rows=2, use_tools=False
    )
    width = batch["input_ids"].size(1)
    for row, expected in zip(out[:, width:].tolist(), ours):
        assert row[: len(expected)] == expected


def test_tokenizer_gives_lockstep_ids(exported) -> None:
    _, tok, _, hf_tok, _ = exported
    for text in TEXTS:
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
        assert hf_tok(text)["input_ids"] == tok.encode(text, prepend="<|bos|>")  # documents start with <|bos|>
        assert hf_tok.decode(tok.encode(text)) == tok.decode(tok.encode(text))
    # special tokens: by name in text, as transformers tokenizers read them, at lockstep's ids
    for name, i in tok.get_special_tokens().items():
        assert hf_tok.convert_tokens_to_ids(name) == i
        assert hf_tok(f"a{name}b", add_special_tokens=False)["input_ids"] == [*tok.encode("a"), i, *tok.encode("b")]
    assert hf_tok.bos_token == "<|bos|>" and hf_tok.eos_token == "<|assistant_end|>"
    assert len(hf_tok) == tok.get_vocab_size()


def test_chat_template_renders_lockstep_chat_format(exported) -> None:
    _, tok, _, hf_tok, _ = exported
    for conversation in CONVERSATIONS:
        messages = conversation["messages"]
        ids, _ = tok.render_conversation(conversation)
        assert hf_tok.apply_chat_template(messages, tokenize=False) == tok.decode(ids)
        assert hf_tok.apply_chat_template(messages, return_dict=True)["input_ids"] == ids
        if messages[-1]["role"] == "user":
            rendered = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
            assert rendered["input_ids"] == tok.render_for_completion(conversation)
    with pytest.raises(Exception, match="roles must alternate"):
        hf_tok.apply_chat_template([{"role": "assistant", "content": "hi"}], tokenize=False)


def test_folder_loads_and_generates_without_lockstep(tmp_path: Path) -> None:
    """In a fresh process where `import lockstep` fails: the modelling code ships in the folder."""
    model, tok = make_checkpoint(tmp_path, "bpe", "tuple")
    folder = tmp_path / "hf"
    export_hf(tmp_path / "ckpt", tmp_path / "tokenizer", folder)
    prompt = tok.render_for_completion(CONVERSATIONS[0])
    script = (
        "import sys; sys.modules['lockstep'] = None\n"
        "import json, torch, transformers\n"
        f"m = transformers.AutoModelForCausalLM.from_pretrained({str(folder)!r}, trust_remote_code=True)\n"
        f"t = transformers.AutoTokenizer.from_pretrained({str(folder)!r}, trust_remote_code=True)\n"
        f"p = {prompt!r}\n"
        "ids = t.apply_chat_template([{'role': 'user', 'content': 'Who are you?'}], add_generation_prompt=True,\n"
        "                            return_dict=True)['input_ids']\n"
        "assert ids == p, (ids, p)\n"
        "out = m.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)\n"
        "print(json.dumps(out[0, len(p):].tolist()))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": "", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    r = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ours = [c[0] for c, _ in Engine(model, tok).generate(prompt, max_tokens=8, temperature=0.0, use_tools=False)]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == ours


@pytest.mark.parametrize("kind", ["char"])
def test_char_tokenizer_exports_with_its_unknown_byte(kind: str, tmp_path: Path) -> None:
    _, tok = make_checkpoint(tmp_path, kind)
    export_hf(tmp_path / "ckpt", tmp_path / "tokenizer", tmp_path / "hf")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", trust_remote_code=False)
    for text in [*TEXTS, "Greek ξψω and ‰ are outside the alphabet"]:
        assert hf_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert tok.count_unknown_bytes(["ξ"]) == 2 and hf_tok("ξ", add_special_tokens=False)["input_ids"] == [0, 0]


def play_texts(n_plays: int) -> list[str]:
    plays = sorted(plays_dir(None).glob("*/*.md"))[:n_plays]
    return [d["text"] for p in plays for d in split_scenes(p.read_text(encoding="utf-8"), p.stem)]


def test_bpe_merges_encode_as_tiktoken_on_plays(tmp_path: Path) -> None:
    """The merges rebuilt from tiktoken's ranks (`bpe_merges`) over a real vocabulary: 2,048 ids
    learnt from three plays, every scene of five plays (two of them unseen) encoded alike."""
    texts = play_texts(5)
    tok = train_tokenizer("bpe", play_texts(3), vocab_size=2048)
    tok.save(tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    exported = hf_tokenizer(tok, tmp_path / "tok")
    assert [e.ids for e in exported.encode_batch(texts, add_special_tokens=False)] == tok.encode(texts)


@pytest.mark.parametrize("kind", ["lz78", "sentencepiece"])
def test_other_kinds_are_refused_saying_which_export(kind: str, tmp_path: Path) -> None:
    make_checkpoint(tmp_path, kind)
    with pytest.raises(
        ExportError, match=f"a {kind} tokenizer does not export.*Kinds that export: bpe, hf, byte, char"
    ):
        export_hf(tmp_path / "ckpt", tmp_path / "tokenizer", tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_cli_exports_and_refuses_with_one_error_line(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "byte")
    args = ["export", "--ckpt", str(tmp_path / "ckpt"), "--tokenizer", str(tmp_path / "tokenizer")]
    r = CliRunner().invoke(cli_app, [*args, "--to", "hf", "--out", str(tmp_path / "hf")])
    assert r.exit_code == 0, r.output
    written = json.loads((tmp_path / "hf" / EXPORT_FILE).read_text())
    assert set(written["files"]) == {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "modeling_lockstep.py",
        "README.md",
    }
    assert written["step"] == 7 and written["tokenizer_kind"] == "byte"
    # again over the earlier export: replaced whole
    assert CliRunner().invoke(cli_app, [*args, "--to", "hf", "--out", str(tmp_path / "hf")]).exit_code == 0
    r = CliRunner().invoke(cli_app, [*args, "--to", "onnx", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2 and "error: --to onnx: the formats lockstep exports to are: hf" in r.output, r.output
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    r = CliRunner().invoke(cli_app, [*args, "--to", "hf", "--out", str(tmp_path / "mine")])
    assert r.exit_code == 2 and "is not an earlier export" in r.output, r.output
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    r = CliRunner().invoke(
        cli_app,
        [
            "export",
            "--to",
            "hf",
            "--ckpt",
            str(tmp_path / "nope"),
            "--tokenizer",
            str(tmp_path / "tokenizer"),
            "--out",
            str(tmp_path / "y"),
        ],
    )
    assert r.exit_code == 2 and "error: " in r.output and "Traceback" not in r.output, r.output


def test_a_tokenizer_without_special_tokens_is_refused(tmp_path: Path) -> None:
    tok = CharTokenizer(sorted(set(CORPUS[0].encode())), specials=False)
    with pytest.raises(ExportError, match="has no special tokens.*tokenizer.options.specials: true"):
        hf_tokenizer(tok, tmp_path)


def test_a_checkpoint_of_another_tokenizer_is_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "a", "byte")
    make_checkpoint(tmp_path / "b", "bpe")
    with pytest.raises(ValueError, match="was trained with tokenizer"):
        export_hf(tmp_path / "a" / "ckpt", tmp_path / "b" / "tokenizer", tmp_path / "hf")
