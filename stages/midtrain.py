"""Stage `midtrain`: continued training of the base model on chat, tool-use and pretraining text,
every token trained. Parses paths, reads the `runtime` and `midtrain` params sections, calls
lockstep.pipeline.train (the model and its shape come from the --init checkpoint); its body is
stages._finetune's, shared with sft."""

from __future__ import annotations

from lockstep.pipeline.train import ERRORS, MidtrainConfig
from stages import _finetune
from stages._common import entry

STAGE_ERRORS = ERRORS


def main(argv: list[str] | None = None) -> int:
    return _finetune.main("midtrain", MidtrainConfig, argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(entry(main, errors=STAGE_ERRORS))
