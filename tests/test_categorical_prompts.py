"""ChatCORE's categorical prompts are nanochat's by default: ARC and MMLU items in the hub's layout,
fetched and read by lockstep, render to the very conversation nanochat's own task code
(`../shared/nanochat/tasks/`, a yardstick, skipped where absent) makes of the same rows, ARC's
own labels included (1-4 on some items), and are scored over those labels. `letter_first`, the
project's older wording, still renders as it did."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lockstep.core.config import ConfigError, build_config
from lockstep.data.snapshot import iter_records
from lockstep.data.sources import fetch_source
from lockstep.data.sources.ai2_arc import Ai2ArcConfig
from lockstep.data.sources.mmlu import MmluConfig
from lockstep.dev.hub_samples_chat import ARC_SCHEMA
from lockstep.evaluate import chat
from lockstep.evaluate.chatcore import BENCHMARKS
from lockstep.pipeline.eval import EvalConfig
from _eval_helpers import ASSISTANT_START, BigramModel, CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
HUB = ROOT / "corpus" / "hub"


def _arc_row(key: str, question: str, texts: list[str], labels: str, answer: str) -> dict[str, Any]:
    return {"id": key, "question": question, "choices": {"text": texts, "label": list(labels)}, "answerKey": answer}


# Rows in ARC's layout with the shapes the real test splits hold beside A-D: five choices, three,
# numeric labels with a 5th choice, a question over two lines.
AWKWARD_ARC = [
    _arc_row("w0", "Which is a gas at room temperature?", ["iron", "salt", "oxygen", "wax", "glass"], "ABCDE", "C"),
    _arc_row("w1", "What do roots take in?", ["water", "light", "sound"], "ABC", "A"),
    _arc_row("w2", "Which planet is largest?", ["Mars", "Venus", "Earth", "Mercury", "Jupiter"], "12345", "5"),
    _arc_row("w3", "A ball is dropped.\nWhat pulls it down?", ["gravity", "wind", "light"], "123", "1"),
]


def _user_text(conversation: dict[str, Any]) -> str:
    return "".join(p["text"] for p in conversation["messages"][0]["content"])


def _reply_text(conversation: dict[str, Any]) -> str:
    return "".join(p["text"] for p in conversation["messages"][1]["content"])


def _nanochat_task(cls: type, parquet: Path) -> Any:
    """One of nanochat's tasks over `parquet`'s rows in file order (its own loader downloads and
    shuffles: the rows are given to it as its loader's table, unshuffled)."""
    from tasks.common import HubDataset, Task

    task = cls.__new__(cls)
    Task.__init__(task)
    task.ds = HubDataset(pq.read_table(parquet))
    return task


def _assert_same_as_nanochat(items: list[chat.CategoricalItem], task: Any) -> None:
    assert len(items) == len(task) > 0
    for i, item in enumerate(items):
        theirs = task[i]
        ours = chat.categorical_prompt(item)
        assert _user_text(ours) == theirs["messages"][0]["content"], f"item {i}"
        assert _reply_text(ours) == theirs["messages"][1]["content"], f"item {i}"
        assert list(chat.prompt_labels(item)) == list(theirs["letters"]), f"item {i}"


@pytest.mark.parametrize("config", ["ARC-Easy", "ARC-Challenge"])
def test_arc_renders_as_nanochat_renders_it_with_its_own_labels(
    nanochat_root: Path, tmp_path: Path, config: str
) -> None:
    from tasks.arc import ARC

    parquet = HUB / "ai2_arc" / config / "test-00000-of-00001.parquet"
    labels = [r["choices"]["label"] for r in pq.read_table(parquet).to_pylist()]
    assert ["A", "B", "C", "D"] in labels and ["1", "2", "3", "4"] in labels  # both kinds are compared
    fetch_source("arc", Ai2ArcConfig(path=str(HUB / "ai2_arc"), config=config), tmp_path / "arc", seed=1)
    items = BENCHMARKS["arc_easy" if config == "ARC-Easy" else "arc_challenge"].read(
        iter_records(tmp_path / "arc", "val")
    )
    _assert_same_as_nanochat(items, _nanochat_task(ARC, parquet))


def test_awkward_arc_rows_render_as_nanochat_renders_them(nanochat_root: Path, tmp_path: Path) -> None:
    from tasks.arc import ARC

    (tmp_path / "hub" / "ARC-Easy").mkdir(parents=True)
    parquet = tmp_path / "hub" / "ARC-Easy" / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(AWKWARD_ARC, schema=ARC_SCHEMA), parquet)
    fetch_source("arc", Ai2ArcConfig(path=str(tmp_path / "hub")), tmp_path / "arc", seed=1)
    items = BENCHMARKS["arc_easy"].read(iter_records(tmp_path / "arc", "val"))
    _assert_same_as_nanochat(items, _nanochat_task(ARC, parquet))
    assert [it.labels for it in items][2:] == [("1", "2", "3", "4", "5"), ("1", "2", "3")]


def test_mmlu_renders_as_nanochat_renders_it(nanochat_root: Path, tmp_path: Path) -> None:
    from tasks.mmlu import MMLU

    fetch_source("mmlu", MmluConfig(path=str(HUB / "mmlu")), tmp_path / "mmlu", seed=1)
    items = BENCHMARKS["mmlu"].read(iter_records(tmp_path / "mmlu", "val"))
    _assert_same_as_nanochat(items, _nanochat_task(MMLU, HUB / "mmlu" / "all" / "test-00000-of-00001.parquet"))


def test_letter_first_keeps_the_older_wording_and_letters_by_position() -> None:
    item = chat.CategoricalItem("Which planet is largest?", ("Mars", "Earth", "Jupiter"), 2, ("1", "2", "3"))
    conv = chat.categorical_prompt(item, "letter_first")
    assert _user_text(conv) == (
        "Which planet is largest?\n\nA. Mars\nB. Earth\nC. Jupiter\n\nAnswer with the letter only."
    )
    assert _reply_text(conv) == "C" and chat.prompt_labels(item, "letter_first") == ("A", "B", "C")
    conv = chat.categorical_prompt(item)
    assert _user_text(conv) == (
        "Multiple Choice question: Which planet is largest?\n- Mars=1\n- Earth=2\n- Jupiter=3\n"
        "\nRespond only with the letter of the correct answer."
    )
    assert _reply_text(conv) == "3"


@pytest.mark.parametrize(("prompt", "predicted"), [("nanochat", ["3", "B"]), ("letter_first", ["B", "B"])])
def test_scoring_is_over_the_labels_the_prompt_shows(prompt: str, predicted: list[str]) -> None:
    tok = CharTokenizer()
    items = chat.categorical_items(
        [
            {"question": "Pick 3", "choices": ["x", "y", "z", "w"], "labels": ["1", "2", "3", "4"], "answer": "3"},
            {"question": "Pick B", "choices": ["x", "y", "z"], "answer": "B"},
        ]
    )
    model = BigramModel()
    with torch.no_grad():  # "3" first, then B; "9" and "E" are no item's labels
        for label, logit in (("9", 20.0), ("E", 15.0), ("3", 9.0), ("B", 5.0), ("A", 1.0)):
            model.table[ASSISTANT_START, tok.encode(label)[0]] = logit
    res = chat.evaluate_categorical(
        model, items, tokenizer=tok, device=torch.device("cpu"), max_seq_len=512, prompt=prompt
    )  # type: ignore[arg-type]
    assert [r["predicted"] for r in res.records] == predicted
    assert (res.correct, res.total) == ((2, 2) if prompt == "nanochat" else (1, 2))


def test_a_snapshot_without_labels_letters_by_position_and_arc_asks_for_a_refetch() -> None:
    old = [{"text": "Q?", "choices": json.dumps(["a", "b", "c", "d"]), "answer": "C", "id": "x"}]
    assert chat.benchmark_categorical_items(old)[0].labels == ("A", "B", "C", "D")
    assert BENCHMARKS["mmlu"].read(old)[0].answer == 2
    with pytest.raises(ValueError, match=r"no `labels` field .*fetch it again \(`dvc repro fetch@"):
        BENCHMARKS["arc_easy"].read(old)


def test_the_setting_defaults_to_nanochat_and_refuses_other_names() -> None:
    assert EvalConfig().categorical_prompt == "nanochat"
    assert build_config(EvalConfig, {"categorical_prompt": "letter_first"}).categorical_prompt == "letter_first"
    with pytest.raises(ConfigError, match=r"eval.categorical_prompt='letters' must be one of \['nanochat', 'letter"):
        build_config(EvalConfig, {"categorical_prompt": "letters"}, where="eval")
    with pytest.raises(ValueError, match="labels"):
        chat.categorical_items([{"question": "q", "choices": ["a", "b"], "labels": ["1", "1"], "answer": 0}])
