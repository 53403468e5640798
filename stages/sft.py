"""Stage `sft`: supervised fine-tuning from the midtrain checkpoint on the SFT mixture, loss on
assistant tokens only (set `sft.loss: assistant`). Parses paths, reads the `runtime` and `sft`
params sections, calls lockstep.pipeline.train (the model comes from the --init checkpoint); its
body is stages._finetune's, shared with midtrain."""

from __future__ import annotations

from lockstep.pipeline.train import ERRORS, SFTConfig
from stages import _finetune
from stages._common import entry

STAGE_ERRORS = ERRORS


def main(argv: list[str] | None = None) -> int:
    return _finetune.main("sft", SFTConfig, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
