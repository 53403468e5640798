"""Fitting a conversation into the model's context: the system message and the latest whole turns
that leave a reply its room, the oldest turns left out and counted, and the refusal when even the
latest user message does not fit. One policy for the terminal chat, the web UI and the API; it
counts tokens through the caller and knows no tokenizer, sampling or front end."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# The least room a fitted conversation leaves for its reply: half the context, or max_tokens when
# that is less. It binds in the tiny preset (256 tokens); larger contexts leave max_tokens (256 by
# default) whole. The tiny preset's training replies, tool calls and outputs included, run to a
# median of 56 / 67 / 124 tokens and a 95th percentile of 81 / 115 / 152 (synthetic chats / math /
# multistep, val split, its 4k BPE): a quarter of the context (64) would cut the median math reply,
# half keeps all but the longest multistep replies whole. The earlier turns it costs matter little
# to models trained on single-turn chats.
REPLY_SHARE_DIVISOR = 2


def min_reply_tokens(context_tokens: int, max_tokens: int) -> int:
    """The room, in tokens, a conversation must leave for a reply of at most `max_tokens` in a
    `context_tokens` context: max_tokens, but no more than half the context (REPLY_SHARE_DIVISOR),
    and at least 1."""
    return max(1, min(max_tokens, context_tokens // REPLY_SHARE_DIVISOR))


@dataclass(frozen=True)
class FittedConversation:
    """What the model is asked with: the system message (if any), then the latest turns that fit,
    ending with the latest user message."""

    messages: list[dict]
    dropped_turns: int  # oldest user+assistant pairs left out
    prompt_tokens: int  # `messages` rendered for completion
    context_tokens: int

    @property
    def room_tokens(self) -> int:
        """Tokens the context has left for the reply."""
        return self.context_tokens - self.prompt_tokens


class ContextFullError(ValueError):
    """Even the latest user message (with the system message, if any) leaves less than the reply's
    room. Carries the sizes, so each front end can say how to fix it in its own terms."""

    def __init__(self, *, prompt_tokens: int, budget_tokens: int, reply_tokens: int, context_tokens: int,
                 system: bool):
        self.prompt_tokens = prompt_tokens  # the latest user message alone, rendered
        self.budget_tokens = budget_tokens  # what a prompt may take
        self.reply_tokens = reply_tokens  # the room kept for the reply
        self.context_tokens = context_tokens
        self.system = system  # the system message is part of prompt_tokens
        super().__init__(self.sizes())

    def sizes(self) -> str:
        """The sizes in words: what is too long, and by what measure."""
        what = "the system message and the latest user message are" if self.system else "the latest user message is"
        return (f"{what} {self.prompt_tokens} tokens with the chat template, over the {self.budget_tokens} the "
                f"model's {self.context_tokens}-token context leaves once {self.reply_tokens} are kept for the reply")


def fit_conversation(
    messages: list[dict],
    *,
    prompt_tokens: Callable[[list[dict]], int],
    context_tokens: int,
    reply_tokens: int,
    max_prompt_tokens: int | None = None,
) -> FittedConversation:
    """Keep the system message and the latest whole turns whose prompt leaves `reply_tokens` of
    `context_tokens` (and is at most `max_prompt_tokens`, when given); leave out the oldest
    user+assistant pairs, never half of one and never the latest user message. `messages` is a
    well-formed conversation (lockstep.infer.chat.check_messages); `prompt_tokens` counts a
    conversation rendered for completion. Raises ContextFullError when the latest user message
    alone does not fit.

    Turns are added from the newest back, so what is tokenized stays near the budget however long
    the conversation: the first turn that does not fit ends the search."""
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(head) :]
    if len(body) % 2 != 1 or body[-1]["role"] != "user":
        raise ValueError("a conversation to fit alternates user and assistant turns and ends with a user message")
    budget_tokens = context_tokens - reply_tokens
    if max_prompt_tokens is not None:
        budget_tokens = min(budget_tokens, max_prompt_tokens)
    pairs = len(body) // 2
    kept = 0
    n_tokens = prompt_tokens(head + body[-1:])
    if n_tokens > budget_tokens:
        raise ContextFullError(prompt_tokens=n_tokens, budget_tokens=budget_tokens, reply_tokens=reply_tokens,
                               context_tokens=context_tokens, system=bool(head))
    while kept < pairs:
        candidate_tokens = prompt_tokens(head + body[len(body) - 3 - 2 * kept :])
        if candidate_tokens > budget_tokens:
            break
        kept += 1
        n_tokens = candidate_tokens
    return FittedConversation(
        messages=head + body[len(body) - 1 - 2 * kept :],
        dropped_turns=pairs - kept,
        prompt_tokens=n_tokens,
        context_tokens=context_tokens,
    )


def dropped_notice(dropped_turns: int, context_tokens: int) -> str:
    """One line saying that turns were left out: "the 2 oldest exchanges no longer fit the model's
    256-token context and are left out". The web UI words its notice the same (static/app.js)."""
    if dropped_turns == 1:
        return f"the oldest exchange no longer fits the model's {context_tokens}-token context and is left out"
    return (f"the {dropped_turns} oldest exchanges no longer fit the model's {context_tokens}-token context "
            "and are left out")
