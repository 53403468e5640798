"""Stage `midtrain`: continued training of the base model on chat, tool-use and pretraining text,
every token trained. The runner is shared with stages.pretrain."""

from __future__ import annotations

from stages._common import entry
from stages.pretrain import STAGE_ERRORS, run


def main(argv: list[str] | None = None) -> int:
    return run("midtrain", argv)


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
