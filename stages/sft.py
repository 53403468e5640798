"""Stage `sft`: supervised fine-tuning from the midtrain checkpoint on the SFT mixture, loss on
assistant tokens only (set `sft.loss: assistant`). The runner is shared with stages.pretrain."""

from __future__ import annotations

from stages._common import entry
from stages.pretrain import STAGE_ERRORS, run


def main(argv: list[str] | None = None) -> int:
    return run("sft", argv)


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
