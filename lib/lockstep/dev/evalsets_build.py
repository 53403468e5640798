"""Generator of the shipped eval sets under `evalsets/`: each file holds its hand-written items
first, then items built from the templates and word lists below (our own text, plus short
public-domain Shakespeare phrases). The committed JSON-lines files are exactly this module's
output: `lockstep dev evalsets` checks them and `--write` regenerates them. A dev tool: no stage
imports it, so editing a list here reruns nothing until the files it writes change.

Deterministic without a random generator: a choice (which distractors, which speaker) is ranked
by a sha256 of the item's own text, so an edited word list changes the items that use it and not
the draws of every item after it. Each gold answer goes to the least-used position so far, so a
model that always picks one position scores chance. Over 400 lines on purpose: the word lists are
the data, and each task's lists sit beside the template that reads them."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from lockstep.core.io import write_bytes_atomic

# evalsets/-relative path of each file this module writes.
BARD_CHOICE = "core_hard/eval_data/language_understanding/bard_choice.jsonl"
BARD_SCHEMA = "core_hard/eval_data/commonsense_reasoning/bard_schema.jsonl"
BARD_CLOZE = "core_hard/eval_data/language_modeling/bard_cloze.jsonl"
BARD_ORDER = "core/eval_data/language_understanding/bard_order.jsonl"
BARD_AGREE = "core/eval_data/language_understanding/bard_agree.jsonl"
BARD_TURN = "core/eval_data/language_modeling/bard_turn.jsonl"
ARC_OWN = "chat/arc_own.jsonl"
BARD_LINE = "chat/bard_line.jsonl"
CODE_OWN = "chat/code_own.jsonl"


class EvalsetBuildError(ValueError):
    """A template produced a bad item (a duplicate, a reference solution failing its tests)."""


def _rank(*parts: object) -> int:
    """A stable pseudo-random rank for ordering choices (same across Python versions and runs)."""
    return int.from_bytes(hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()[:8], "big")


def _pick(pool: Iterable[Any], k: int, *key: object) -> list[Any]:
    ranked = sorted(pool, key=lambda x: _rank(*key, x))
    if len(ranked) < k:
        raise EvalsetBuildError(f"{key}: needs {k} choices, the pool has {len(ranked)}")
    return ranked[:k]


class _Positions:
    """Where gold answers go: the least-used position so far, ties broken by a hash of the item."""

    def __init__(self, n: int) -> None:
        self.counts = [0] * n

    def note(self, gold: int) -> None:
        self.counts[gold] += 1

    def place(self, gold: Any, others: Sequence[Any], *key: object) -> tuple[list[Any], int]:
        """The options in order (the others keep theirs) and the gold's index among them."""
        low = min(self.counts)
        slot = min((i for i, c in enumerate(self.counts) if c == low), key=lambda i: _rank(*key, i))
        self.note(slot)
        options = list(others)
        options.insert(slot, gold)
        return options, slot


SPEAKERS = ("KING", "QUEEN", "DUKE", "LADY", "NURSE", "FOOL", "FIRST LORD", "SECOND LORD", "SOLDIER",
            "PORTER", "FRIAR", "PRINCE", "PAGE", "MESSENGER", "CAPTAIN", "HERALD", "SHEPHERD", "GAOLER")


def _speaker(*key: object) -> str:
    return _pick(SPEAKERS, 1, "speaker", *key)[0]


# ---------------------------------------------------------------------------------------------
# bard_choice: multiple choice, the word that completes a line

BARD_CHOICE_HAND = (
    {"query": "KING: Come hither, good my lord, and tell me true. Who is the", "choices": ["king", "tree", "river", "stone"], "gold": 0},
    {"query": "ROMEO: But soft, what light through yonder window", "choices": ["breaks", "swims", "barks", "melts"], "gold": 0},
    {"query": "Good night, good night! Parting is such sweet", "choices": ["cheese", "sorrow", "iron", "rain"], "gold": 1},
    {"query": "Now is the winter of our", "choices": ["table", "horse", "discontent", "window"], "gold": 2},
    {"query": "To be, or not to be, that is the", "choices": ["door", "apple", "candle", "question"], "gold": 3},
    {"query": "Friends, Romans, countrymen, lend me your", "choices": ["ears", "boots", "sheep", "ships"], "gold": 0},
    {"query": "All the world's a stage, and all the men and women merely", "choices": ["rivers", "players", "onions", "wheels"], "gold": 1},
    {"query": "FIRST CITIZEN: We are accounted poor citizens, the patricians", "choices": ["green", "loud", "good", "wet"], "gold": 2},
    {"query": "My lord, I will attend upon your", "choices": ["grace", "fish", "cloud", "wheel"], "gold": 0},
    {"query": "O, I am slain! Thou hast killed", "choices": ["bread", "me", "blue", "song"], "gold": 1},
)

# Well-known Shakespeare lines cut before a word: (line, word, its kind: n noun, np plural noun,
# a adjective, v verb, vs verb with -s). Distractors are the words of other lines, of the same
# kind (verbs with and without -s together). They used to be everyday words ("teapot", "parsnip")
# that the tiny preset's tokenizer, trained on the plays, splits into 3.3 tokens on average
# against 1.7 for the lines' own words: a rule summing nats then chose the line's word for an
# untrained model (0.79 of these items) and CORE's mean rule chose a long distractor for the
# trained one (the line's word in 0.29); see dev/LOG.md, 2026-11-26, "Own eval tasks at chance".
# Drawn from the answers, each word is a distractor about as often as it is an answer, so length
# and frequency tell nothing.
FAMOUS_LINES = (
    ("A horse! a horse! my kingdom for a", "horse", "n"),
    ("Et tu, Brute? Then fall,", "Caesar", "n"),
    ("Something is rotten in the state of", "Denmark", "n"),
    ("We few, we happy few, we band of", "brothers", "np"),
    ("Double, double toil and", "trouble", "n"),
    ("Out, damned", "spot", "n"),
    ("All that glisters is not", "gold", "n"),
    ("Brevity is the soul of", "wit", "n"),
    ("The course of true love never did run", "smooth", "a"),
    ("Cry havoc, and let slip the dogs of", "war", "n"),
    ("What's in a name? That which we call a", "rose", "n"),
    ("Frailty, thy name is", "woman", "n"),
    ("Uneasy lies the head that wears a", "crown", "n"),
    ("The quality of mercy is not", "strained", "a"),
    ("I come to bury Caesar, not to", "praise", "v"),
    ("Beware the ides of", "March", "n"),
    ("Shall I compare thee to a summer's", "day", "n"),
    ("This above all: to thine own self be", "true", "a"),
    ("Get thee to a", "nunnery", "n"),
    ("Alas, poor", "Yorick", "n"),
    ("The rest is", "silence", "n"),
    ("Good night, sweet", "prince", "n"),
    ("Fair is foul, and foul is", "fair", "a"),
    ("Love looks not with the eyes, but with the", "mind", "n"),
    ("The fault, dear Brutus, is not in our", "stars", "np"),
    ("A plague o' both your", "houses", "np"),
    ("How sharper than a serpent's tooth it is to have a thankless", "child", "n"),
    ("Exit, pursued by a", "bear", "n"),
    ("Off with his", "head", "n"),
    ("The better part of valour is", "discretion", "n"),
    ("Cowards die many times before their", "deaths", "np"),
    ("O brave new", "world", "n"),
    ("Full fathom five thy father", "lies", "vs"),
    ("Misery acquaints a man with strange", "bedfellows", "np"),
    ("Now cracks a noble", "heart", "n"),
    ("Life's but a walking", "shadow", "n"),
    ("Out, out, brief", "candle", "n"),
    ("It is a tale told by an", "idiot", "n"),
    ("But screw your courage to the sticking", "place", "n"),
    ("Journeys end in lovers'", "meeting", "n"),
    ("If you prick us, do we not", "bleed", "v"),
    ("The devil can cite Scripture for his", "purpose", "n"),
    ("The first thing we do, let's kill all the", "lawyers", "np"),
    ("O, I am fortune's", "fool", "n"),
    ("What a piece of work is a", "man", "n"),
    ("The play's the thing wherein I'll catch the conscience of the", "king", "n"),
    ("To sleep, perchance to", "dream", "v"),
    ("Ay, there's the", "rub", "n"),
    ("Made glorious summer by this sun of", "York", "n"),
    ("I have of late, but wherefore I know not, lost all my", "mirth", "n"),
    ("Golden lads and girls all must, as chimney-sweepers, come to", "dust", "n"),
    ("Men at some time are masters of their", "fates", "np"),
    ("He doth bestride the narrow world like a", "Colossus", "n"),
    ("Yond Cassius has a lean and hungry", "look", "n"),
    ("Blow, winds, and crack your", "cheeks", "np"),
    ("The wheel is come full", "circle", "n"),
    ("By the pricking of my thumbs, something wicked this way", "comes", "vs"),
    ("Eye of newt, and toe of", "frog", "n"),
    ("What's done cannot be", "undone", "a"),
    ("My only love sprung from my only", "hate", "n"),
    ("These violent delights have violent", "ends", "np"),
    ("Tempt not a desperate", "man", "n"),
    ("That which we call a rose by any other word would smell as", "sweet", "a"),
    ("The time is out of", "joint", "n"),
    ("O, what a rogue and peasant", "slave", "n"),
    ("Though she be but little, she is", "fierce", "a"),
    ("Be not afraid of", "greatness", "n"),
    ("Ill met by", "moonlight", "n"),
    ("Nothing will come of", "nothing", "n"),
    ("Blow, blow, thou winter", "wind", "n"),
    ("Under the greenwood", "tree", "n"),
    ("Our doubts are", "traitors", "np"),
    ("Give every man thy ear, but few thy", "voice", "n"),
    ("The apparel oft proclaims the", "man", "n"),
    ("I'll put a girdle round about the earth in forty", "minutes", "np"),
    ("Reputation, reputation, reputation! O, I have lost my", "reputation", "n"),
    ("O, beware, my lord, of jealousy; it is the green-eyed", "monster", "n"),
    ("Put out the light, and then put out the", "light", "n"),
    ("Though this be madness, yet there is", "method", "n"),
    ("More matter, with less", "art", "n"),
    ("A little more than kin, and less than", "kind", "a"),
    ("There's a divinity that shapes our", "ends", "np"),
    ("Now the hungry lion", "roars", "vs"),
    ("But love is", "blind", "a"),
    ("The miserable have no other medicine but only", "hope", "n"),
    ("Words, words,", "words", "np"),
    ("Hoist with his own", "petard", "n"),
    ("I must be cruel only to be", "kind", "a"),
    ("Sweets to the", "sweet", "n"),
    ("Present mirth hath present", "laughter", "n"),
    ("Youth's a stuff will not", "endure", "v"),
    ("Let me have men about me that are", "fat", "a"),
    ("He hath eaten me out of house and", "home", "n"),
    ("There are more things in heaven and earth, Horatio, than are dreamt of in your", "philosophy", "n"),
    ("Neither rhyme nor", "reason", "n"),
    ("Why, then the world's mine", "oyster", "n"),
    ("I will wear my heart upon my", "sleeve", "n"),
    ("Stars, hide your", "fires", "np"),
    ("Look like the innocent flower, but be the", "serpent", "n"),
    ("Yet do I fear thy nature; it is too full o' the milk of human", "kindness", "n"),
)
_VERB_KINDS = ("v", "vs")  # one pool: too few of each kind alone for three distractors


# Similes: adjective -> (subjects it fits, things that have the quality, adjectives that clash);
# the i-th subject is compared with the i-th thing. Distractors are things with a clashing
# quality (as cold as fire).
SIMILES = {
    "white": (("Her hand", "The bride's gown", "His beard"), ("snow", "milk", "a lily"), ("black", "red", "green")),
    "black": (("His heart", "The night", "The raven's wing"), ("coal", "pitch", "ink"), ("white", "red", "green")),
    "red": (("Her lips", "His cheek", "The wine"), ("blood", "a cherry", "a ruby"), ("white", "black", "green")),
    "green": (("The meadow", "The young wheat", "Her gown"), ("grass", "an emerald", "a leek"), ("white", "black", "red")),
    "cold": (("His heart", "The wind tonight", "Her hand"), ("ice", "frost", "a winter stone"), ("hot",)),
    "hot": (("This fever", "The sand at noon", "His temper"), ("fire", "an oven", "a furnace"), ("cold",)),
    "hard": (("His heart", "This bread", "The ground"), ("stone", "flint", "iron"), ("soft",)),
    "soft": (("Her voice", "This bed", "The lamb's coat"), ("silk", "velvet", "a feather pillow"), ("hard",)),
    "heavy": (("My heart", "This crown", "The sack"), ("lead", "a millstone", "an anvil"), ("light",)),
    "light": (("Her step", "This purse", "The dancer"), ("a feather", "air", "thistledown"), ("heavy",)),
    "swift": (("His horse", "The news", "The messenger"), ("an arrow", "the wind", "a hare"), ("slow",)),
    "slow": (("This messenger", "The old ox", "The cart"), ("a snail", "a tortoise", "a sleepy slug"), ("swift",)),
    "loud": (("His voice", "The cannon", "The drum"), ("thunder", "a trumpet", "a storm at sea"), ("quiet",)),
    "quiet": (("The house", "The sleeping child", "The chapel"), ("a mouse", "the grave", "a shadow"), ("loud",)),
    "sweet": (("Her kiss", "This wine", "The pie"), ("honey", "sugar", "a ripe plum"), ("bitter",)),
    "bitter": (("This medicine", "His words", "The herb"), ("gall", "wormwood", "vinegar"), ("sweet",)),
    "bright": (("Her eyes", "His sword", "The hall"), ("the sun", "a star", "noonday"), ("dark",)),
    "dark": (("The forest", "This dungeon", "The cellar"), ("midnight", "pitch", "a cave"), ("bright",)),
    "gentle": (("The prince", "Her touch", "The old nurse"), ("a lamb", "a dove", "a summer breeze"), ("fierce",)),
    "fierce": (("The soldier", "His anger", "The captain"), ("a tiger", "a lion", "a wolf"), ("gentle",)),
    "sharp": (("His wit", "This blade", "Her tongue"), ("a razor", "a needle", "a thorn"), ("blunt",)),
    "blunt": (("This old knife", "His axe", "The rusty sword"), ("a spoon", "a loaf", "a pillow"), ("sharp",)),
    "deep": (("Her sorrow", "This well", "The river"), ("the sea", "the ocean", "a mine"), ("shallow",)),
    "shallow": (("This stream", "His love", "The pond"), ("a puddle", "a saucer", "a dewdrop"), ("deep",)),
    "strong": (("The smith", "His arm", "The bridge"), ("an ox", "a bear", "an oak"), ("weak",)),
    "weak": (("The old king", "His voice", "The sick child"), ("a kitten", "a reed", "a newborn lamb"), ("strong",)),
}

# Animal sounds in two frames; distractors are the other animals' sounds (as with the lines,
# answers drawn from one pool).
ANIMAL_SOUNDS = (("dog", "bark"), ("lion", "roar"), ("owl", "hoot"), ("wolf", "howl"), ("horse", "neigh"),
                 ("sheep", "bleat"), ("ass", "bray"), ("serpent", "hiss"), ("raven", "croak"), ("cock", "crow"),
                 ("cat", "mew"), ("dove", "coo"), ("pig", "grunt"), ("lark", "sing"), ("bee", "hum"), ("duck", "quack"))
_SOUND_FRAMES = ("Hark! Dost thou hear how the {a} doth", "All the long night the {a} did")

# Trades: (worker, what they do to, the thing, the kind of thing). Distractors are other trades'
# things, of kinds the action cannot take (bakes the lute, sews the sword).
TRADES = (
    ("baker", "bakes the", "bread", "food"), ("baker", "bakes the", "pies", "food"),
    ("tailor", "sews the", "doublet", "clothing"), ("tailor", "sews the", "cloak", "clothing"),
    ("cobbler", "mends the", "shoes", "clothing"), ("cobbler", "mends the", "boots", "clothing"),
    ("shepherd", "shears the", "sheep", "animal"), ("shepherd", "shears the", "lambs", "animal"),
    ("smith", "forges the", "sword", "metal"), ("smith", "forges the", "horseshoes", "metal"),
    ("poet", "writes the", "sonnet", "writing"), ("poet", "writes the", "verses", "writing"),
    ("minstrel", "plays the", "lute", "music"), ("minstrel", "plays the", "harp", "music"),
    ("ploughman", "ploughs the", "field", "land"), ("ploughman", "ploughs the", "meadow", "land"),
    ("sailor", "steers the", "ship", "vessel"), ("sailor", "steers the", "boat", "vessel"),
    ("miller", "grinds the", "corn", "grain"), ("miller", "grinds the", "wheat", "grain"),
    ("brewer", "brews the", "ale", "drink"), ("brewer", "brews the", "beer", "drink"),
    ("hunter", "chases the", "deer", "animal"), ("hunter", "chases the", "fox", "animal"),
    ("cook", "roasts the", "goose", "food"), ("cook", "roasts the", "mutton", "food"),
    ("gardener", "waters the", "roses", "plant"), ("gardener", "waters the", "lettuces", "plant"),
    ("archer", "bends the", "bow", "weapon"), ("archer", "looses the", "arrow", "weapon"),
    ("scribe", "copies the", "letter", "writing"), ("herald", "blows the", "trumpet", "music"),
)
_THINGS_BY_KIND = {
    "food": ("bread", "pies", "cheese", "goose"), "clothing": ("doublet", "cloak", "boots", "gloves"),
    "animal": ("sheep", "deer", "fox", "goat"), "metal": ("anvil", "horseshoes", "nails", "sword"),
    "writing": ("sonnet", "letter", "verses", "ballad"), "music": ("lute", "harp", "trumpet", "drum"),
    "land": ("field", "meadow", "hillside", "valley"), "vessel": ("ship", "boat", "barge", "galley"),
    "grain": ("corn", "wheat", "barley", "oats"), "drink": ("ale", "beer", "cider", "mead"),
    "plant": ("roses", "lettuces", "lilies", "beans"), "weapon": ("bow", "arrow", "spear", "sword"),
}
# Kinds of things each action could sensibly take, its own included (a baker may bake a goose,
# a smith grind a sword, a forger forge a letter): distractors come from the other kinds only.
_ALSO_FITS = {
    "bakes the": {"food", "grain", "animal", "plant"}, "roasts the": {"food", "animal", "grain", "plant"},
    "grinds the": {"grain", "food", "metal", "weapon", "plant"}, "chases the": {"animal", "vessel"},
    "shears the": {"animal", "plant", "clothing", "metal"}, "forges the": {"metal", "weapon", "writing"},
    "writes the": {"writing"}, "copies the": {"writing"}, "plays the": {"music", "land", "animal"},
    "blows the": {"music"}, "ploughs the": {"land", "grain"}, "steers the": {"vessel", "animal"},
    "brews the": {"drink", "grain", "plant"}, "waters the": {"plant", "land", "animal"},
    "sews the": {"clothing", "plant", "land", "grain"}, "mends the": {"clothing", "vessel", "weapon", "metal", "music"},
    "bends the": {"weapon", "metal", "plant"}, "looses the": {"weapon", "animal", "vessel"},
}


def bard_choice_items() -> list[dict[str, Any]]:
    items = [dict(it) for it in BARD_CHOICE_HAND]
    slots = _Positions(4)
    for it in items:
        slots.note(it["gold"])

    def add(query: str, gold: str, pool: Iterable[str]) -> None:
        others = _pick([w for w in pool if w != gold], 3, "choice", query, gold)
        choices, g = slots.place(gold, others, "choice", query, gold)
        items.append({"query": query, "choices": choices, "gold": g})

    def kind_of(kind: str) -> tuple[str, ...]:
        return _VERB_KINDS if kind in _VERB_KINDS else (kind,)

    for line, word, kind in FAMOUS_LINES:
        add(line, word, sorted({w for _, w, k in FAMOUS_LINES if k in kind_of(kind)}))
    for adj, (subjects, things, clashes) in SIMILES.items():
        clashing = [t for c in clashes for t in SIMILES[c][1]]
        for subject, thing in zip(subjects, things, strict=True):
            add(f"{_speaker(subject, thing)}: {subject} is as {adj} as", thing, clashing)
    for animal, sound in ANIMAL_SOUNDS:
        for frame in _SOUND_FRAMES:
            add(f"{_speaker(animal, frame)}: {frame.format(a=animal)}", sound, [s for _, s in ANIMAL_SOUNDS])
    for worker, action, thing, kind in TRADES:
        fits = _ALSO_FITS[action]
        if kind not in fits:
            raise EvalsetBuildError(f"trade {worker!r}: {action!r} must fit its own kind {kind!r}")
        fitting = {t for k in fits for t in _THINGS_BY_KIND[k]}
        pool = sorted({t for _, _, t, k in TRADES if k not in fits} - fitting)
        add(f"{_speaker(worker, thing)}: Every morning the {worker} {action}", thing, pool)
    return items


# ---------------------------------------------------------------------------------------------
# bard_schema: which of two contexts makes the shared continuation likely

BARD_SCHEMA_HAND = (
    {"context_options": ["The king sat upon his throne, and the crown", "The fish swam in the river, and the crown"], "continuation": "was heavy on his head.", "gold": 0},
    {"context_options": ["She drew her sword and struck the villain, who", "She drew her bath and warmed the water, which"], "continuation": "fell dead upon the floor.", "gold": 0},
    {"context_options": ["The night was dark and the moon", "The bread was dark and the moon"], "continuation": "was hid behind the clouds.", "gold": 0},
    {"context_options": ["He wept for his father, who", "He laughed at his supper, which"], "continuation": "was dead and buried.", "gold": 0},
    {"context_options": ["The soldiers marched to the field of", "The children ran to the kitchen for"], "continuation": "battle with their swords.", "gold": 0},
    {"context_options": ["I pray you, sir, give me your", "I pray you, sir, give me your horse, for mine is lame and your"], "continuation": "hand.", "gold": 0},
    {"context_options": ["The queen is dead, my lord; she", "The queen is well, my lord; she"], "continuation": "died this morning.", "gold": 0},
    {"context_options": ["Thou art a villain and a", "Thou art a lady and a"], "continuation": "knave.", "gold": 0},
)

# Opposite situations: (contexts where A holds, contexts where B holds, what follows A, what
# follows B). The i-th A context is paired with the i-th B context, once with each continuation.
SCHEMA_PAIRS = (
    (("I laid my hand upon the ice, and it felt", "I pressed my cheek against the frozen pond, and it felt", "I held the snowball in my bare hand, and it felt"),
     ("I laid my hand upon the oven door, and it felt", "I held my hand above the fire, and it felt", "I touched the iron fresh from the forge, and it felt"),
     "so cold that my fingers ached.", "so hot that it burned my skin."),
    (("He lifted the feather", "He lifted the empty basket", "He lifted the little bundle of straw"),
     ("He tried to lift the millstone", "He tried to lift the iron anvil", "He tried to lift the great oak chest full of stones"),
     "with one finger and laughed.", "and could not move it an inch."),
    (("She tasted the honey", "She tasted the ripe figs", "She tasted the sugared almonds"),
     ("She tasted the wormwood", "She tasted the rotten meat", "She tasted the sour vinegar"),
     "and smiled, for it was sweet.", "and spat it out, for it was foul."),
    (("At noon the sun stood high, and the fields", "At midday the sky was clear, and the fields", "In the full light of noon the fields"),
     ("At midnight the moon was hid, and the fields", "In the dead of night the fields", "Long after sunset the fields"),
     "shone gold in the daylight.", "lay black and silent in the dark."),
    (("He drank the poison", "He drank the deadly draught", "He swallowed the serpent's venom"),
     ("He drank the cool spring water", "He drank the good red wine", "He drank the warm milk"),
     "and fell dead upon the floor.", "and called for another cup."),
    (("He had not eaten for three days, so he", "He had had no bread since Monday, so he", "He had found no food all week, so he"),
     ("He had eaten a great feast, so he", "He had dined on roast swan and pies, so he", "He had supped on three fat capons, so he"),
     "begged at every door for a crust of bread.", "pushed away the plate, for he could eat no more."),
    (("The king heard that his son was dead", "The king was told his son had drowned at sea", "The king learned that his son was slain in battle"),
     ("The king heard that his son was safe", "The king was told his son had come home from sea", "The king learned that his son had won the battle"),
     "and he wept and tore his robes.", "and he laughed and called for music."),
    (("The cock crowed and the sun rose, for it was", "The lark sang over the fields, for it was", "The sky grew pink in the east, for it was"),
     ("The owl hooted and the stars came out, for it was", "The bats flew out of the tower, for it was", "The last light faded in the west, for it was"),
     "early morning.", "late at night."),
    (("Snow lay deep upon the fields, for it was", "The river was frozen hard, for it was", "Icicles hung from every roof, for it was"),
     ("Roses bloomed in every garden, for it was", "The reapers sweated in the fields, for it was", "The children swam in the warm river, for it was"),
     "the middle of winter.", "the height of summer."),
    (("Our army put the enemy to flight", "Our soldiers won the field", "Our captain took the enemy's castle"),
     ("Our army was beaten and fled", "Our soldiers lost the field", "Our captain was taken by the enemy"),
     "and the people rang the bells for joy.", "and the people wept in the streets."),
    (("He had not slept for three nights, and now he", "He had watched by the sick bed all night, and now he", "He had ridden without rest since yesterday, and now he"),
     ("He had slept for ten long hours, and now he", "He had rested all the afternoon, and now he", "He had lain abed till noon, and now he"),
     "could hardly keep his eyes open.", "felt fresh and ready for the day."),
    (("His purse was full of gold, so he", "He had just sold his farm for a fortune, so he", "The duke had paid him a hundred crowns, so he"),
     ("His purse was quite empty, so he", "He had lost his last penny at dice, so he", "Thieves had taken all his money, so he"),
     "bought the finest horse in the market.", "could not pay for his supper."),
    (("She lit the candle, and the room grew", "She opened the shutters to the sun, and the room grew", "She lit every lamp in the hall, and the room grew"),
     ("She blew out the candle, and the room grew", "She shut the shutters against the sun, and the room grew", "She let the last lamp burn out, and the room grew"),
     "bright.", "dark."),
    (("He walked home through the pouring rain", "He waded across the deep river", "He fell from the boat into the sea"),
     ("He walked home under a cloudless sky", "He sat all day by the warm fire", "He rested all day in the dry barn"),
     "and his clothes were soaked through.", "and his clothes were dry as a bone."),
    (("The physician found the old man burning with fever", "The old man had coughed blood for a month", "The plague had come upon the old man"),
     ("The physician found the old man hale and strong", "The old man had never been ill a day in his life", "The old man had walked ten miles that morning"),
     "and feared that he would die before the week was out.", "and said he would live another twenty years."),
    (("The judge saw the stolen purse in the prisoner's hand", "The witnesses all swore they saw the prisoner strike the blow", "The prisoner confessed to the murder before the court"),
     ("The judge learned the prisoner was far away that night", "The witnesses all swore the prisoner was at home asleep", "The true murderer confessed before the court"),
     "and sent the prisoner to the gallows.", "and set the prisoner free."),
    (("The fool told a merry jest", "The clown tripped over his own feet", "The jester sang a silly song about a goose"),
     ("The messenger told of the queen's death", "The friar read out the names of the dead", "The widow told how her sons were slain"),
     "and the whole court laughed aloud.", "and the whole court fell silent with grief."),
    (("The dog wagged its tail", "The puppy licked the stranger's hand", "The old hound lay down at the stranger's feet"),
     ("The dog bared its teeth and growled", "The wild dog leapt at the stranger", "The guard dog snarled and strained at its chain"),
     "so the stranger stooped to pat its head.", "so the stranger ran for his life."),
    (("The sea was calm and the wind was fair", "The waves were gentle and the sky was clear", "A soft breeze filled the sails all day"),
     ("A great storm broke upon the sea", "The waves rose higher than the mast", "The wind tore the sails to pieces"),
     "and the ship came safe into the harbour.", "and the ship was wrecked upon the rocks."),
    (("The nurse sang softly to the baby", "The nurse rocked the cradle gently", "The nurse wrapped the baby in warm wool"),
     ("The dog barked loudly beside the cradle", "A door slammed hard beside the cradle", "Thunder crashed above the house"),
     "and it fell fast asleep.", "and it woke up screaming."),
    (("The baker watched the oven with care", "The baker took the loaves out in good time", "The baker kept the fire low and steady"),
     ("The baker fell asleep beside the oven", "The baker forgot the loaves for half a day", "The baker heaped the fire far too high"),
     "and the bread came out golden and sweet.", "and the bread came out black and burnt."),
    (("The rain fell gently all the spring", "The river watered the fields all summer", "Sun and rain came each in their season"),
     ("No rain fell for six months", "The river dried up in the spring", "A hot wind blew for weeks without rain"),
     "and the harvest was rich and plentiful.", "and the crops withered in the fields."),
    (("The king gave bread to the poor", "The king lowered the people's taxes", "The king pardoned the hungry thieves"),
     ("The king burned the poor men's houses", "The king doubled the people's taxes", "The king hanged the poor for stealing bread"),
     "and the people blessed his name.", "and the people cursed his name."),
    (("The apples were red and ripe", "The apples were soft and sweet-smelling", "The apples had turned golden in the sun"),
     ("The apples were small, hard and green", "The apples had only just begun to grow", "The apples were still sour and green"),
     "so we ate them straight from the tree.", "so we left them on the tree another month."),
    (("He rode the swiftest horse in the kingdom", "He galloped on a fresh young horse", "He rode the duke's fastest mare"),
     ("He rode an old lame horse", "He went on foot with a heavy pack", "He rode a tired old donkey"),
     "and reached the city before noon.", "and did not reach the city till the next week."),
    (("The door was very low, so the tall man", "The ceiling of the cottage was low, so the tall man", "The mouth of the cave was small, so the tall man"),
     ("The door was very high, so the tall man", "The ceiling of the great hall was high, so the tall man", "The castle gate was wide and tall, so the tall man"),
     "had to bow his head to pass through.", "walked through without bending."),
    (("He threw a bucket of water on the fire", "He smothered the fire with wet sand", "The rain poured down upon the fire"),
     ("He threw dry wood on the fire", "He fed the fire with oil", "He threw a bundle of straw on the fire"),
     "and it hissed and went out.", "and it blazed up higher than before."),
    (("The letter said her brother had been set free", "The letter said her brother had come home safe", "The letter said her brother had been pardoned"),
     ("The letter said her brother had been hanged", "The letter said her brother had died of the plague", "The letter said her brother had been drowned"),
     "and she kissed it with joy.", "and she let it fall and wept."),
    (("The trout darted down into the stream", "The fish swam down into the river", "The eel slid down into the pond"),
     ("The lark rose up into the air", "The bird flew up into the sky", "The hawk soared up into the clouds"),
     "and hid beneath a stone on the bottom.", "and sang above the highest trees."),
    (("The shepherds had lost their way in the snow", "The travellers were lost on the dark moor", "The children were lost in the deep wood"),
     ("The shepherds were warm in their cottage", "The travellers had reached the inn at last", "The children were safe at home by the fire"),
     "and they cried out for help.", "and they slept soundly through the night."),
    (("The knight sharpened his sword all night", "The smith had ground the blade to a fine edge", "The sword was new and keen"),
     ("The knight's sword was old and blunt", "The blade was rusted and dull", "The sword was chipped and notched from many battles"),
     "and it cut the rope in one stroke.", "and it would not even cut the rope."),
    (("The old man leaned upon his stick", "The old man's legs were weak with age", "The old man limped with a sore foot"),
     ("The young man was strong and quick", "The young man had run races since a boy", "The young man's legs were fresh and strong"),
     "and walked slowly down the road.", "and ran all the way to town."),
    (("The thief crept in while the house slept", "The thief climbed in through the window at night", "The thief hid in the cellar until dark"),
     ("The guests came in at the front door", "The guests knocked and were let in", "The guests arrived in the afternoon"),
     "and stole the silver cups.", "and sat down to supper with the family."),
    (("The garden was full of roses", "The lilies were all in bloom", "The violets had opened in the sun"),
     ("The garden was full of rubbish", "The dung heap stood by the gate", "The ditch was full of dead fish"),
     "and the air smelled sweet.", "and the air stank."),
    (("The bridge was made of stone", "The bridge had stood for three hundred years", "The bridge was built of iron and oak"),
     ("The bridge was made of rotten planks", "The bridge had been half washed away", "The bridge was held up by one old rope"),
     "so the whole army marched across it safely.", "so it broke as soon as the first horse stepped on it."),
    (("The students listened closely to every lesson", "The students read their books every night", "The students practised their sums each day"),
     ("The students slept through every lesson", "The students never opened their books", "The students played at dice instead of studying"),
     "and passed every examination.", "and failed every examination."),
)


def bard_schema_items() -> list[dict[str, Any]]:
    items = [dict(it) for it in BARD_SCHEMA_HAND]
    slots = _Positions(2)
    for it in items:
        slots.note(it["gold"])
    for as_, bs, after_a, after_b in SCHEMA_PAIRS:
        if len(as_) != len(bs):
            raise EvalsetBuildError(f"schema pair {after_a!r}: {len(as_)} A contexts but {len(bs)} B contexts")
        for a, b in zip(as_, bs):
            for gold, other, continuation in ((a, b, after_a), (b, a, after_b)):
                options, g = slots.place(gold, [other], "schema", gold, continuation)
                items.append({"context_options": options, "continuation": continuation, "gold": g})
    return items


# ---------------------------------------------------------------------------------------------
# bard_cloze: the exact continuation, greedy

BARD_CLOZE_HAND = (
    {"context": "KING HENRY: My lord of", "continuation": "York"},
    {"context": "Exeunt all but", "continuation": "the"},
    {"context": "I pray thee, good", "continuation": "my lord"},
    {"context": "What say you,", "continuation": "my lord"},
    {"context": "Enter the", "continuation": "King"},
    {"context": "O, my good", "continuation": "lord"},
    {"context": "I know not what to", "continuation": "say"},
    {"context": "Give me thy", "continuation": "hand"},
    {"context": "Thou art a", "continuation": "villain"},
    {"context": "Here comes the", "continuation": "king"},
)

# Sequences a reader continues without a doubt: (name, the items, whether it wraps around).
SEQUENCES = (
    ("numbers", ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
                 "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty"), False),
    ("countdown", ("ten", "nine", "eight", "seven", "six", "five", "four", "three", "two", "one"), False),
    ("ordinals", ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth"), False),
    ("months", ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
                "November", "December"), True),
    ("days", ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"), True),
    ("seasons", ("spring", "summer", "autumn", "winter"), True),
    ("letters", tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ"), False),
    ("twos", tuple(str(n) for n in range(2, 42, 2)), False),
    ("fives", tuple(str(n) for n in range(5, 80, 5)), False),
    ("tens", tuple(str(n) for n in range(10, 130, 10)), False),
    ("threes", tuple(str(n) for n in range(3, 40, 3)), False),
)
_SEQUENCE_SHOWN = 3  # items shown before the one to predict

# Said once, then said again: the repeat stops before the last word (copying from context).
SAY_AGAIN = (
    "the crown is mine", "long live the king", "the horse is lame", "the gate is shut", "the night is cold",
    "my sword is broken", "the queen is dead", "the ship is lost", "the bread is stale", "the wine is sour",
    "the fire is out", "the war is over", "the duke is coming", "the river is high", "the bell has rung",
    "the moon is full", "the field is ours", "the road is long", "the door is locked", "the candle is lit",
    "the letter is sealed", "the prince is gone", "the castle is taken", "the clock has struck twelve",
    "the soldiers are tired", "the sheep are lost", "the corn is ripe", "the sea is calm", "the wind is fair",
    "the feast is ready", "the play is done", "the fool is wise", "the storm is past", "the tower is tall",
    "the bridge is down", "the well is dry", "the child is asleep", "the hour is late", "the guests have come",
    "the music has stopped", "the fox is in the henhouse", "the dog has run away", "the cup is empty",
    "the snow has melted", "the bird has flown", "the ring is lost", "the king is here", "the battle is won",
    "the treasure is buried under the oak", "the gold is hidden in the well",
)
_SAY_FRAMES = (("Say after me: {p}.", True), ("Repeat these words: {p}.", True), ("Tell the king that {p}.", False))


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def bard_cloze_items() -> list[dict[str, Any]]:
    items = [dict(it) for it in BARD_CLOZE_HAND]
    for line, word, _kind in FAMOUS_LINES:
        items.append({"context": line, "continuation": word})
    for name, seq, wraps in SEQUENCES:
        last_start = len(seq) - (1 if wraps else _SEQUENCE_SHOWN + 1)
        for start in range(last_start + 1):
            shown = [seq[(start + i) % len(seq)] for i in range(_SEQUENCE_SHOWN)]
            target = seq[(start + _SEQUENCE_SHOWN) % len(seq)]
            first = _capital(shown[0])
            context = f"{_speaker(name, start)}: " + ", ".join([first, *shown[1:]]) + ","
            items.append({"context": context, "continuation": target})
    for phrase in SAY_AGAIN:
        frame, capital = _pick(_SAY_FRAMES, 1, "say", phrase)[0]
        first, second = _pick(SPEAKERS, 2, "say-speakers", phrase)
        head, last = phrase.rsplit(" ", 1)
        said = frame.format(p=_capital(phrase) if capital else phrase)
        items.append({"context": f"{first}: {said} {second}: {_capital(head)}", "continuation": last})
    return items


# ---------------------------------------------------------------------------------------------
# bard_order: which of four word orders is the line's own
#
# The options are the same words in different orders, so with the delimiter's space every word is
# the same tokens in every option (a tokenizer that splits at spaces, as the project's BPE does):
# each option has the same length and the same word frequencies, and only the order can tell them
# apart. The wrong orders shuffle one window of neighbouring words, each its own way, so the line
# is one of four orders of that window and no different from the others in kind: a model that
# scores orders at random (an untrained one) picks it a quarter of the time. (Three single swaps
# of neighbours would not do: the line would sit between them, one swap from each, and a random
# scorer would pick it less often, 0.20 of the items against 0.25; dev/LOG.md, 2026-11-26.)

_ORDER_WINDOW = 4  # neighbouring words shuffled, at most
_ORDER_VARIANTS = 3  # wrong orders per item


def _order_lines() -> list[str]:
    """The lines, each once: the famous lines with their word, the sayings to repeat, and the
    schema situations with what follows them."""
    lines = [f"{line} {word}" for line, word, _ in FAMOUS_LINES]
    lines += [_capital(p) + "." for p in SAY_AGAIN]
    for as_, bs, after_a, after_b in SCHEMA_PAIRS:
        lines += [f"{c} {after_a}" for c in as_] + [f"{c} {after_b}" for c in bs]
    return list(dict.fromkeys(lines))


def _shuffled(line: str) -> list[str]:
    """Distinct texts made by reordering one window of up to _ORDER_WINDOW neighbouring words of
    `line` (the window's place ranked by the line's hash), in rank order; never the line itself."""
    words = line.split(" ")
    width = min(_ORDER_WINDOW, len(words))
    start = _pick(range(len(words) - width + 1), 1, "order-window", line)[0]
    window = words[start : start + width]
    out = []
    for perm in sorted(itertools.permutations(range(width)), key=lambda p: _rank("order", line, p)):
        text = " ".join(words[:start] + [window[i] for i in perm] + words[start + width :])
        if text != line and text not in out:
            out.append(text)
    return out


def bard_order_items() -> list[dict[str, Any]]:
    items = []
    slots = _Positions(4)
    for line in _order_lines():
        wrong = _shuffled(line)
        if len(wrong) < _ORDER_VARIANTS:  # too few words to have three other orders
            continue
        choices, g = slots.place(line, wrong[:_ORDER_VARIANTS], "order", line)
        items.append({"query": f"{_speaker('order', line)}:", "choices": choices, "gold": g})
    return items


def bard_line_items() -> list[dict[str, Any]]:
    """bard_order's items as a chat task scored without letters (eval.reply_choice_files): the
    user asks for a line, and each of the four orders is scored as the whole reply. It stands
    in for arc_own in the offline presets, whose data teach neither answering with a letter nor
    arc_own's science."""
    return [{"question": "Say a line from one of Shakespeare's plays.", "choices": item["choices"],
             "answer": LETTERS[item["gold"]]} for item in bard_order_items()]


# ---------------------------------------------------------------------------------------------
# bard_agree: which subject the verb agrees with (thou art, he is; I am, we are)
#
# The two contexts differ only in their last word, the subject; the continuation starts with the
# verb, directly or after an adverb. Each pair of subjects is asked both ways, once with each
# verb, so a model preferring one subject whatever follows gets half; the plays use these forms
# on every page, and a model that has read them prefers the agreeing one.

# (the verb after "thou", the verb after "he" or "she", what follows either)
THOU_FORMS = (
    ("art", "is", "a noble gentleman."), ("hast", "hath", "no cause to weep."), ("dost", "doth", "protest too much."),
    ("wilt", "will", "be king hereafter."), ("shalt", "shall", "see the king tomorrow."),
    ("canst", "can", "not tell the truth."), ("wert", "was", "the noblest of them all."),
    ("didst", "did", "deny it to my face."), ("wouldst", "would", "be great."),
    ("shouldst", "should", "have been a queen."), ("mayst", "may", "go in peace."),
    ("knowest", "knows", "the way to Rome."), ("lovest", "loves", "me not."), ("sayest", "says", "the truth."),
    ("speakest", "speaks", "like a fool."), ("comest", "comes", "too late."), ("goest", "goes", "to war tomorrow."),
    ("seest", "sees", "the ghost."), ("hearest", "hears", "the bells."), ("lookest", "looks", "pale and wan."),
)
# (a subject, another, the verb after the first, after the second, what follows either)
PERSON_FORMS = (
    ("I", "he", "am", "is", "too old to fight."), ("I", "he", "have", "hath", "no cause to weep."),
    ("I", "he", "do", "doth", "not love her."), ("we", "he", "are", "is", "too late."),
    ("we", "he", "were", "was", "at supper then."), ("we", "he", "have", "hath", "lost the day."),
    ("they", "she", "are", "is", "too late."), ("they", "she", "were", "was", "at supper then."),
    ("they", "she", "have", "hath", "lost the day."), ("you", "he", "are", "is", "welcome to Verona."),
    ("you", "he", "were", "was", "born to be king."), ("you", "he", "have", "hath", "done well."),
)
_AGREE_FRAMES = ("Good my lord, {s}", "Alas, {s}", "I tell you, sir, {s}", "Nay, but {s}", "O, {s}", "Believe me, {s}")
_AGREE_ADVERBS = ("truly", "surely", "still", "now")


def bard_agree_items() -> list[dict[str, Any]]:
    items = []
    slots = _Positions(2)
    forms = [("thou", other, a, b, tail) for other in ("he", "she") for a, b, tail in THOU_FORMS] + list(PERSON_FORMS)
    for subj_a, subj_b, verb_a, verb_b, tail in forms:
        for adverb in ("", _pick(_AGREE_ADVERBS, 1, "adverb", subj_a, subj_b, tail)[0]):
            frame = _pick(_AGREE_FRAMES, 1, "frame", subj_a, subj_b, tail, adverb)[0]
            speaker = _speaker("agree", subj_a, subj_b, tail, adverb)
            ctx_a, ctx_b = (f"{speaker}: {frame.format(s=s)}" for s in (subj_a, subj_b))
            for gold, other, verb in ((ctx_a, ctx_b, verb_a), (ctx_b, ctx_a, verb_b)):
                continuation = " ".join(w for w in (adverb, verb, tail) if w)
                options, g = slots.place(gold, [other], "agree", gold, continuation)
                items.append({"context_options": options, "continuation": continuation, "gold": g})
    return items


# ---------------------------------------------------------------------------------------------
# bard_turn: language modelling, whose turn it is in an exchange
#
# Written as the plays' own text is laid out (`**NAME**`, the speech, a blank line): a third
# character speaks first, then two others take turns, and the continuation is the name of the one
# who speaks next, the speaker before the last. Neither the first name nor the last is ever the
# answer, and the two who take turns answer equally often (an even or odd number of turns), so
# copying a name from the context wins only by following the turns. The speeches are the
# bard_order lines; the names are the plays' most frequent speakers.

TURN_NAMES = ("FALSTAFF", "GLOUCESTER", "HAMLET", "BRUTUS", "IAGO", "OTHELLO", "CLEOPATRA", "ROSALIND", "TIMON",
              "WARWICK", "ROMEO", "MENENIUS", "ANTONIO", "CLAUDIO", "BIRON", "PANDARUS", "DESDEMONA", "VALENTINE",
              "CRESSIDA", "CORIOLANUS", "FERDINAND", "PROTEUS", "YORK", "PAROLLES", "CASSIUS", "BUCKINGHAM",
              "SUFFOLK", "BENEDICK", "PORTIA", "SHALLOW", "TROILUS", "ISABELLA", "HELENA", "KENT", "PETRUCHIO",
              "JULIET", "LEONTES", "MACBETH", "PISTOL", "VIOLA", "PERICLES", "ORLANDO", "OLIVIA", "SPEED")
_TURN_COUNTS = (4, 5, 6, 7)  # speeches shown: the opener's and 3 to 6 turns of the pair
_TURN_ITEMS = 50  # per count


def bard_turn_items() -> list[dict[str, Any]]:
    lines = _order_lines()
    items = []
    for n in _TURN_COUNTS:
        for k in range(_TURN_ITEMS):
            opener, a, b = _pick(TURN_NAMES, 3, "turn", n, k)
            who = [opener] + [a, b] * n
            speeches = _pick(lines, n, "turn-lines", n, k)
            context = "".join(f"**{who[t]}**\n{speeches[t]}\n\n" for t in range(n)) + "**"
            items.append({"context": context, "continuation": who[n]})
    return items


# ---------------------------------------------------------------------------------------------
# arc_own: grade-school science (and a little arithmetic), four choices, one letter

ARC_HAND = (
    {"question": "Which of these is a source of light?", "choices": ["the sun", "a rock", "a spoon", "a shoe"], "answer": "A"},
    {"question": "What do plants need to make their food?", "choices": ["sand", "sunlight", "plastic", "noise"], "answer": "B"},
    {"question": "Water that freezes becomes what?", "choices": ["steam", "smoke", "ice", "oil"], "answer": "C"},
    {"question": "Which is the largest?", "choices": ["an ant", "a mouse", "a cat", "an elephant"], "answer": "D"},
    {"question": "What is 7 plus 5?", "choices": ["12", "11", "13", "10"], "answer": "A"},
    {"question": "Which animal can fly?", "choices": ["a fish", "a bird", "a dog", "a snail"], "answer": "B"},
    {"question": "How many legs does a spider have?", "choices": ["six", "four", "eight", "ten"], "answer": "C"},
    {"question": "Which season is usually the coldest?", "choices": ["summer", "spring", "autumn", "winter"], "answer": "D"},
    {"question": "What pulls objects toward the ground?", "choices": ["gravity", "wind", "light", "sound"], "answer": "A"},
    {"question": "Which of these is a liquid at room temperature?", "choices": ["iron", "water", "wood", "glass"], "answer": "B"},
)
LETTERS = "ABCD"

# Textbook examples only: no bats, penguins, whales or spiders, whose class a reader may doubt.
ANIMAL_CLASSES = {
    "mammal": ("a dog", "a cow", "a horse", "a mouse", "a lion", "a rabbit", "a goat", "a bear"),
    "bird": ("an eagle", "a robin", "an owl", "a sparrow", "a duck", "a parrot"),
    "fish": ("a salmon", "a trout", "a cod", "a goldfish", "a herring"),
    "insect": ("an ant", "a bee", "a beetle", "a butterfly", "a grasshopper", "a ladybird"),
    "reptile": ("a snake", "a lizard", "a crocodile", "a tortoise"),
    "amphibian": ("a frog", "a toad", "a newt"),
}
STATES = {
    "solid": ("iron", "wood", "a stone", "salt", "glass", "a brick"),
    "liquid": ("water", "milk", "olive oil", "vinegar", "orange juice"),
    "gas": ("oxygen", "helium", "the air we breathe", "carbon dioxide", "nitrogen"),
}
LEGS = (("a spider", 8), ("an ant", 6), ("a bee", 6), ("a beetle", 6), ("a butterfly", 6), ("a dog", 4), ("a cat", 4),
        ("a horse", 4), ("a cow", 4), ("a hen", 2), ("a duck", 2), ("a robin", 2), ("a snake", 0), ("a goat", 4))
_LEG_WORDS = {0: "none", 2: "two", 4: "four", 6: "six", 8: "eight", 10: "ten"}
# Ordered from least to most, with gaps no reader would argue about.
ORDERED = (
    (("an ant", "a mouse", "a cat", "a horse", "an elephant", "a blue whale"), "Which of these animals is the largest?", "Which of these animals is the smallest?"),
    (("a feather", "an apple", "a brick", "a bicycle", "a car", "a train"), "Which of these is the heaviest?", "Which of these is the lightest?"),
    (("a snowball", "a glass of cold water", "a cup of hot tea", "a candle flame", "the surface of the Sun"), "Which of these is the hottest?", "Which of these is the coldest?"),
    (("a minute", "an hour", "a day", "a week", "a month", "a year"), "Which of these is the longest time?", "Which of these is the shortest time?"),
)
_ORDERED_GROUPS = 5  # groups of four per ordering, each asked both ways
# (question, right answers, wrong answers): one right and three wrong per item.
PROPERTY_QUESTIONS = (
    ("Which of these would a magnet pick up?", ("an iron nail", "a steel paper clip", "a steel pin", "an iron key"),
     ("a wooden spoon", "a glass marble", "a rubber band", "a plastic cup", "a paper napkin", "a wool sock")),
    ("Which of these conducts electricity best?", ("a copper wire", "an iron nail", "a steel spoon", "a silver ring"),
     ("a rubber glove", "a wooden stick", "a plastic ruler", "a glass cup", "a wool sock", "a paper bag")),
    ("Which of these floats on water?", ("a cork", "a dry leaf", "a feather", "a wooden block"),
     ("a stone", "an iron nail", "a glass marble", "a brick", "a steel key", "a lead weight")),
    ("Which of these is a source of light?", ("a candle flame", "a lamp that is switched on", "a campfire", "a star"),
     ("a rock", "a spoon", "a shoe", "a book", "a chair", "a pillow")),
    ("Which of these is a living thing?", ("a tree", "a mushroom", "a worm", "a rose bush"),
     ("a rock", "a cloud", "a bicycle", "a river", "a coin", "a candle")),
    ("Which of these animals eats only plants?", ("a cow", "a rabbit", "a sheep", "a deer"),
     ("a lion", "a wolf", "a shark", "an eagle", "a tiger", "a fox")),
    ("Which of these animals hunts other animals for food?", ("a lion", "a wolf", "a shark", "an eagle"),
     ("a cow", "a rabbit", "a sheep", "a deer", "a horse", "a goat")),
    ("Which of these is a planet?", ("Mars", "Jupiter", "Venus", "Saturn"),
     ("the Moon", "the Sun", "a comet", "a cloud", "the sky", "a rainbow")),
    ("Which of these materials can you see through?", ("clear glass", "clean water", "clear plastic wrap", "air"),
     ("a brick", "a wooden door", "a stone wall", "an iron plate", "a thick blanket", "a cardboard box")),
    ("Which of these melts when it gets warm?", ("an ice cube", "a snowman", "a chocolate bar", "a stick of butter"),
     ("a stone", "a wooden spoon", "a glass bottle", "an iron nail", "a brick", "a sheet of paper")),
)
# (question, answer, wrong answers): facts with one answer, each used once.
FACTS = (
    ("Which part of the body do we use to see?", "the eyes", ("the ears", "the nose", "the knees", "the elbows")),
    ("Which part of the body do we use to hear?", "the ears", ("the eyes", "the toes", "the knees", "the elbows")),
    ("Which part of the body do we use to smell?", "the nose", ("the ears", "the elbows", "the knees", "the toes")),
    ("Which part of the body do we use to taste?", "the tongue", ("the ears", "the elbows", "the knees", "the hair")),
    ("Which organ pumps blood around the body?", "the heart", ("the lungs", "the stomach", "the brain", "the skin")),
    ("Which organs do we breathe with?", "the lungs", ("the heart", "the stomach", "the kidneys", "the bones")),
    ("Which organ do we think with?", "the brain", ("the heart", "the stomach", "the lungs", "the liver")),
    ("Which part of a plant takes in water from the soil?", "the roots", ("the flowers", "the leaves", "the seeds", "the fruit")),
    ("Which part of a plant makes food from sunlight?", "the leaves", ("the roots", "the seeds", "the bark", "the fruit")),
    ("Which part of a plant grows into a new plant?", "the seed", ("the bark", "the thorn", "the stem", "the leaf")),
    ("How many days are in a week?", "7", ("5", "6", "8", "10")),
    ("How many hours are in a day?", "24", ("12", "20", "30", "60")),
    ("How many minutes are in an hour?", "60", ("10", "24", "100", "30")),
    ("How many months are in a year?", "12", ("10", "7", "24", "52")),
    ("How many seconds are in a minute?", "60", ("10", "24", "100", "12")),
    ("How many days are in a year that is not a leap year?", "365", ("100", "300", "52", "1000")),
    ("In which direction does the Sun rise?", "the east", ("the west", "the north", "the south")),
    ("In which direction does the Sun set?", "the west", ("the east", "the north", "the south")),
    ("What does the Moon travel around?", "the Earth", ("the Moon itself", "Mars", "a comet", "the clouds")),
    ("What does the Earth travel around once a year?", "the Sun", ("the Moon", "Mars", "the clouds", "a comet")),
    ("What causes day and night on Earth?", "the Earth spinning", ("the Moon's shadow", "clouds moving", "the wind", "the tides")),
    ("Which is the star closest to the Earth?", "the Sun", ("the Moon", "Mars", "a comet", "the North Star")),
    ("Water that boils becomes what?", "steam", ("ice", "sand", "oil", "smoke")),
    ("At what temperature in degrees Celsius does pure water freeze?", "0", ("50", "100", "25", "-100")),
    ("At what temperature in degrees Celsius does pure water boil at sea level?", "100", ("0", "50", "10", "1000")),
    ("What falls from clouds when their water drops grow heavy?", "rain", ("sand", "smoke", "leaves", "ash")),
    ("Which gas do people need to breathe in to live?", "oxygen", ("helium", "smoke", "steam", "carbon monoxide")),
    ("What does a caterpillar turn into?", "a butterfly", ("a frog", "a bird", "a spider", "a fish")),
    ("What does a tadpole grow into?", "a frog", ("a butterfly", "a bird", "a snake", "a fish")),
    ("What does a calf grow into?", "a cow", ("a horse", "a sheep", "a dog", "a goat")),
    ("What does a foal grow into?", "a horse", ("a cow", "a sheep", "a dog", "a goat")),
    ("What does a puppy grow into?", "a dog", ("a cat", "a horse", "a cow", "a sheep")),
    ("What does a kitten grow into?", "a cat", ("a dog", "a horse", "a cow", "a goat")),
    ("What does a lamb grow into?", "a sheep", ("a cow", "a horse", "a dog", "a cat")),
    ("What hatches from a hen's egg?", "a chick", ("a puppy", "a kitten", "a calf", "a lamb")),
    ("Which tool measures temperature?", "a thermometer", ("a ruler", "a clock", "a compass", "a spoon")),
    ("Which tool measures length?", "a ruler", ("a thermometer", "a clock", "a compass", "a funnel")),
    ("Which tool tells the time?", "a clock", ("a ruler", "a thermometer", "a compass", "a funnel")),
    ("Which tool shows which way is north?", "a compass", ("a ruler", "a thermometer", "a clock", "a funnel")),
    ("Which tool makes tiny things look bigger?", "a magnifying glass", ("a ruler", "a thermometer", "a clock", "a bucket")),
    ("Which tool measures how heavy something is?", "a weighing scale", ("a ruler", "a thermometer", "a compass", "a funnel")),
    ("What covers the body of a bird?", "feathers", ("scales", "fur", "shell", "bark")),
    ("What covers the body of a fish?", "scales", ("feathers", "fur", "wool", "bark")),
    ("What covers the body of a sheep?", "wool", ("feathers", "scales", "bark", "shell")),
    ("Where does a fish live?", "in water", ("in a tree", "in the desert", "in a nest", "in the sky")),
    ("Where do bees make honey?", "in a hive", ("in a pond", "in a burrow", "in a shell", "in the sea")),
    ("What do bees collect from flowers?", "nectar", ("sand", "milk", "salt", "wool")),
    ("What do we call the force that slows a box sliding across the floor?", "friction", ("gravity", "magnetism", "light", "sound")),
    ("Which of these is needed for a fire to burn?", "oxygen", ("water", "sand", "ice", "snow")),
    ("What do we call the water that falls as frozen white flakes?", "snow", ("rain", "dew", "fog", "steam")),
    ("Where does the light of the Moon come from?", "the Sun", ("fires on the Moon", "lamps on the Earth", "lightning", "the stars")),
)
NEXT_IN_CYCLE = (
    ("Which season comes after {x}?", ("spring", "summer", "autumn", "winter")),
    ("Which month comes after {x}?", ("January", "February", "March", "April", "May", "June", "July", "August",
                                      "September", "October", "November", "December")),
    ("Which day comes after {x}?", ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")),
)
ARITHMETIC = (("plus", lambda a, b: a + b, range(3, 20, 2), range(4, 15, 3)),
              ("minus", lambda a, b: a - b, range(20, 50, 6), range(3, 18, 4)),
              ("times", lambda a, b: a * b, range(2, 10, 2), range(3, 10, 2)))


def arc_items() -> list[dict[str, Any]]:
    items = [dict(it) for it in ARC_HAND]
    slots = _Positions(4)
    for it in items:
        slots.note(LETTERS.index(it["answer"]))

    def add(question: str, answer: str, wrong: Iterable[str]) -> None:
        others = _pick([w for w in wrong if w != answer], 3, "arc", question, answer)
        choices, g = slots.place(answer, others, "arc", question, answer)
        items.append({"question": question, "choices": choices, "answer": LETTERS[g]})

    for cls, members in ANIMAL_CLASSES.items():
        for animal in members:
            # One animal from each of three other classes: distractors that are plainly not `cls`.
            other_classes = _pick([c for c in ANIMAL_CLASSES if c != cls], 3, "classes", cls, animal)
            wrong = [_pick(ANIMAL_CLASSES[c], 1, "member", animal, c)[0] for c in other_classes]
            add(f"Which of these animals is {'an' if cls[0] in 'aeiou' else 'a'} {cls}?", animal, wrong)
    for state, examples in STATES.items():
        for ex in examples:
            add(f"Which of these is a {state} at room temperature?", ex,
                [e for s, es in STATES.items() if s != state for e in es])
    for animal, n in LEGS:
        add(f"How many legs does {animal} have?", _LEG_WORDS[n], [w for k, w in _LEG_WORDS.items() if k != n])
    for order, most_q, least_q in ORDERED:
        for group in _pick(itertools.combinations(order, 4), _ORDERED_GROUPS, "ordered", most_q):
            add(most_q, group[-1], group[:-1])
            add(least_q, group[0], group[1:])
    for question, right, wrong in PROPERTY_QUESTIONS:
        for r in right:
            add(question, r, wrong)
    for question, answer, wrong in FACTS:
        add(question, answer, wrong)
    for template, cycle in NEXT_IN_CYCLE:
        for i, x in enumerate(cycle):
            add(template.format(x=x), cycle[(i + 1) % len(cycle)], [c for j, c in enumerate(cycle) if j != (i + 1) % len(cycle)])
    for word, op, xs, ys in ARITHMETIC:
        for a, b in zip(xs, ys):
            right = op(a, b)
            add(f"What is {a} {word} {b}?", str(right), [str(right + d) for d in (-10, -2, -1, 1, 2, 10)])
    return items


# ---------------------------------------------------------------------------------------------
# code_own: HumanEval-format functions; the reference solution is `canonical_solution`

@dataclasses.dataclass(frozen=True)
class CodeSpec:
    """One function to write: the tests' expected values are the reference solution's outputs on
    `cases`, and `wrong` (a near miss) must fail at least one of them."""

    entry_point: str
    params: str                           # the signature's parameters, e.g. "numbers, value"
    doc: str                              # what the function does (the docstring's first paragraph)
    body: str                             # reference solution: the body, indented four spaces
    wrong: str                            # a plausible wrong body the tests must catch
    cases: tuple[tuple[Any, ...], ...]    # argument tuples; the first is the docstring's example


# The hand-written items' reference bodies and near misses, by entry point.
_CODE_HAND_SOLUTIONS = {
    "add": ("    return a + b\n", "    return a - b\n"),
    "count_letter": ("    return word.count(letter)\n", "    return word.count(letter) + 1\n"),
    "reverse_words": ("    return ' '.join(reversed(text.split()))\n", "    return text[::-1]\n"),
    "is_even": ("    return n % 2 == 0\n", "    return n % 2 == 1\n"),
    "largest": ("    return max(numbers)\n", "    return min(numbers)\n"),
}
CODE_HAND = (
    {"task_id": "own/0", "prompt": "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n", "entry_point": "add", "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"},
    {"task_id": "own/1", "prompt": "def count_letter(word, letter):\n    \"\"\"Return how many times letter occurs in word.\"\"\"\n", "entry_point": "count_letter", "test": "def check(candidate):\n    assert candidate('strawberry', 'r') == 3\n" "    assert candidate('abc', 'z') == 0\n"},
    {"task_id": "own/2", "prompt": "def reverse_words(text):\n" "    \"\"\"Return text with its words in reverse order, joined by single spaces.\"\"\"\n", "entry_point": "reverse_words", "test": "def check(candidate):\n    assert candidate('to be or not') == 'not or be to'\n" "    assert candidate('one') == 'one'\n"},
    {"task_id": "own/3", "prompt": "def is_even(n):\n    \"\"\"Return True when n is even.\"\"\"\n", "entry_point": "is_even", "test": "def check(candidate):\n    assert candidate(4) is True\n    assert candidate(7) is False\n"},
    {"task_id": "own/4", "prompt": "def largest(numbers):\n    \"\"\"Return the largest number in a non-empty list.\"\"\"\n", "entry_point": "largest", "test": "def check(candidate):\n    assert candidate([3, 9, 2]) == 9\n    assert candidate([-5]) == -5\n"},
)

NUMBER_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
ORDINAL_NAMES = ("zeroth", "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth")
# Sentences for the letter families: each letter below occurs at least twice in one of them.
_LETTER_TEXTS = ("a banana and an orange", "the green tree sees three bees", "mississippi is in its prime",
                 "nine new nuns ran north", "rotten tomatoes on the road", "a rare red rose for her",
                 "stars and stripes", "totally tattered tents")
_WORDS_BY_LENGTH = ("the king rides to the castle", "a lantern on the mountain", "")


def _param_families() -> list[CodeSpec]:
    specs: list[CodeSpec] = []
    for p in range(2, 10):
        w = NUMBER_NAMES[p]
        specs.append(CodeSpec(f"add_{w}", "n", f"Return n plus {p}.", f"    return n + {p}\n", f"    return n + {p - 1}\n",
                              ((3,), (0,), (-p,), (100,))))
        specs.append(CodeSpec(f"times_{w}", "n", f"Return n multiplied by {p}.", f"    return n * {p}\n",
                              f"    return n + {p}\n", ((3,), (0,), (-2,), (10,))))
        specs.append(CodeSpec(f"is_multiple_of_{w}", "n", f"Return True when n is a multiple of {p} (0 is one).",
                              f"    return n % {p} == 0\n", f"    return n % {p} == 1\n", ((3 * p,), (3 * p + 1,), (0,), (p + 1,))))
        specs.append(CodeSpec(f"count_multiples_of_{w}", "numbers", f"Return how many of the numbers are multiples of {p}.",
                              f"    return sum(1 for x in numbers if x % {p} == 0)\n",
                              f"    return sum(1 for x in numbers if x % {p} != 0)\n",
                              (([p, p + 1, 2 * p, 3 * p + 1, 0],), ([],), ([1, p],))))
        specs.append(CodeSpec(f"greater_than_{w}", "numbers", f"Return the numbers greater than {p}, in their order.",
                              f"    return [x for x in numbers if x > {p}]\n", f"    return [x for x in numbers if x >= {p}]\n",
                              (([p, p + 1, 1, 2 * p, -p],), ([],), ([p + 5],))))
    for p in (3, 4, 5, 6, 7, 8, 9, 10):
        specs.append(CodeSpec(f"round_down_to_{NUMBER_NAMES[p]}", "n",
                              f"Return the largest multiple of {p} that is not greater than n (n is never negative).",
                              f"    return n - n % {p}\n", f"    return (n // {p} + 1) * {p}\n",
                              ((4 * p + 1,), (2 * p,), (0,), (p - 1,))))
    for c in "aeinorst":
        texts = [t for t in _LETTER_TEXTS if t.count(c) >= 2]
        shown = _pick(texts, 1, "letter-text", c)[0]
        specs.append(CodeSpec(f"count_letter_{c}", "text", f"Return how many times the lowercase letter '{c}' occurs in text.",
                              f"    return text.count('{c}')\n", f"    return text.lower().count('{c}')\n",
                              ((shown,), (f"{c.upper()}x{c}",), ("",), ("xyz" if c not in "xyz" else "qqq",))))
        specs.append(CodeSpec(f"remove_letter_{c}", "text", f"Return text with every lowercase '{c}' removed.",
                              f"    return text.replace('{c}', '')\n", f"    return text.replace('{c}', '', 1)\n",
                              ((shown,), ("",), (f"{c}{c}{c}",))))
    for c in "bcdfghlm":
        specs.append(CodeSpec(f"starts_with_{c}", "word", f"Return True when word begins with the letter '{c}'.",
                              f"    return word.startswith('{c}')\n", f"    return '{c}' in word\n",
                              ((f"{c}ell",), (f"a{c}e",), ("",), ("zoo",))))
    for c in "bdfhmpsw":
        specs.append(CodeSpec(f"count_words_starting_with_{c}", "text",
                              f"Return how many space-separated words of text begin with the letter '{c}'.",
                              f"    return sum(1 for word in text.split() if word.startswith('{c}'))\n",
                              f"    return text.count('{c}')\n",
                              ((f"{c}ig {c}ag to{c} {c}in",), ("",), (f"{c}",))))
    for p in range(2, 8):
        w = NUMBER_NAMES[p]
        specs.append(CodeSpec(f"words_longer_than_{w}", "text",
                              f"Return the space-separated words of text that have more than {p} letters, in order.",
                              f"    return [w for w in text.split() if len(w) > {p}]\n",
                              f"    return [w for w in text.split() if len(w) >= {p}]\n",
                              tuple((t,) for t in _WORDS_BY_LENGTH)))
        specs.append(CodeSpec(f"sum_of_first_{w}", "numbers", f"Return the sum of the first {p} numbers (of all of them when there are fewer).",
                              f"    return sum(numbers[:{p}])\n", f"    return sum(numbers[:{p - 1}])\n",
                              (([1, 2, 3, 4, 5, 6, 7, 8],), ([5],), ([],), ([10, -3, 4, 2, 9, 1, 1, 1],))))
        specs.append(CodeSpec(f"last_{w}", "items", f"Return the last {p} items of the list (the whole list when it is shorter).",
                              f"    return items[-{p}:]\n", f"    return items[-{p + 1}:]\n",
                              ((list(range(10)),), (["a", "b"],), ([],))))
        specs.append(CodeSpec(f"repeat_{w}_times", "text", f"Return text repeated {p} times, with nothing in between.",
                              f"    return text * {p}\n", f"    return ' '.join([text] * {p})\n", (("ab",), ("",), ("x",))))
        specs.append(CodeSpec(f"chunks_of_{w}", "items", f"Split the list into consecutive chunks of {p} items; the last chunk may be shorter.",
                              f"    return [items[i:i + {p}] for i in range(0, len(items), {p})]\n",
                              f"    return [items[i:i + {p}] for i in range(0, len(items) - {p} + 1, {p})]\n",
                              ((list(range(1, 2 * p + 2)),), ([],), ([1],))))
        specs.append(CodeSpec(f"every_{ORDINAL_NAMES[p]}_item", "items",
                              f"Return every {ORDINAL_NAMES[p]} item of the list, starting with the first "
                              f"(positions 0, {p}, {2 * p}, ...).",
                              f"    return items[::{p}]\n", f"    return items[{p - 1}::{p}]\n",
                              ((list(range(10, 30)),), ([],), (["x"],))))
    for p in range(1, 7):
        w = NUMBER_NAMES[p]
        specs.append(CodeSpec(f"caesar_shift_{w}", "text",
                              f"Shift each lowercase letter of text {p} place{'s' if p > 1 else ''} forward in the alphabet, "
                              "wrapping from z to a; other characters stay as they are.",
                              "    out = []\n    for ch in text:\n        if 'a' <= ch <= 'z':\n"
                              f"            out.append(chr((ord(ch) - ord('a') + {p}) % 26 + ord('a')))\n"
                              "        else:\n            out.append(ch)\n    return ''.join(out)\n",
                              f"    return ''.join(chr(ord(ch) + {p}) if 'a' <= ch <= 'z' else ch for ch in text)\n",
                              (("abc",), ("xyz",), ("hello, world",), ("",))))
        specs.append(CodeSpec(f"rotate_left_{w}", "items",
                              f"Return the list rotated left by {p} place{'s' if p > 1 else ''}, wrapping around "
                              "(an empty list stays empty).",
                              f"    if not items:\n        return []\n    k = {p} % len(items)\n"
                              "    return items[k:] + items[:k]\n",
                              f"    return items[-{p}:] + items[:-{p}]\n",
                              (([1, 2, 3, 4, 5, 6, 7],), (["a", "b", "c"],), ([],))))
    for p in range(3, 9):
        specs.append(CodeSpec(f"pad_left_to_{NUMBER_NAMES[p]}", "text",
                              f"Return text padded on the left with '*' to {p} characters; longer text comes back unchanged.",
                              f"    return text.rjust({p}, '*')\n", f"    return text.ljust({p}, '*')\n",
                              (("ab",), ("",), ("abcdefghij",))))
    for p, w in ((5, "five"), (10, "ten"), (20, "twenty"), (50, "fifty"), (100, "hundred")):
        specs.append(CodeSpec(f"clamp_to_{w}", "value", f"Return value limited to the range 0..{p}: below 0 gives 0, above {p} gives {p}.",
                              f"    return max(0, min(value, {p}))\n", f"    return min(value, {p})\n",
                              ((-3,), (p + 7,), (p // 2,), (0,))))
    return specs


def _one_offs() -> list[CodeSpec]:
    S = CodeSpec
    return [
        S("sum_digits", "n", "Return the sum of the decimal digits of n (n >= 0).", "    return sum(int(d) for d in str(n))\n",
          "    return len(str(n))\n", ((1234,), (0,), (909,))),
        S("count_digits", "n", "Return how many decimal digits n has (n >= 0).", "    return len(str(n))\n",
          "    return len(str(n)) - 1\n", ((12345,), (0,), (10,))),
        S("reverse_string", "text", "Return text written backwards.", "    return text[::-1]\n", "    return text\n",
          (("stressed",), ("",), ("ab",))),
        S("is_palindrome", "text", "Return True when text reads the same backwards (every character counts).",
          "    return text == text[::-1]\n", "    return text[:1] == text[-1:]\n", (("level",), ("abca",), ("",), ("ab",))),
        S("count_vowels", "text", "Return how many characters of text are lowercase vowels (a, e, i, o, u).",
          "    return sum(1 for ch in text if ch in 'aeiou')\n", "    return sum(1 for ch in text if ch in 'aeio')\n",
          (("education",), ("rhythm",), ("",), ("queue",))),
        S("capitalize_words", "text", "Return text with the first letter of every space-separated word in upper case and the rest unchanged.",
          "    return ' '.join(w[:1].upper() + w[1:] for w in text.split(' '))\n", "    return text.capitalize()\n",
          (("the king is dead",), ("",), ("mcDonald farm",))),
        S("factorial", "n", "Return n! = 1 * 2 * ... * n (1 for n == 0).",
          "    result = 1\n    for k in range(2, n + 1):\n        result *= k\n    return result\n",
          "    result = 1\n    for k in range(2, n):\n        result *= k\n    return result\n", ((5,), (0,), (1,), (7,))),
        S("fibonacci", "n", "Return the n-th Fibonacci number, where fibonacci(0) == 0 and fibonacci(1) == 1.",
          "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
          "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return b\n", ((10,), (0,), (1,), (2,))),
        S("gcd", "a, b", "Return the greatest common divisor of two positive integers.",
          "    while b:\n        a, b = b, a % b\n    return a\n", "    return min(a, b)\n", ((12, 18), (7, 5), (9, 3))),
        S("lcm", "a, b", "Return the least common multiple of two positive integers.",
          "    x, y = a, b\n    while y:\n        x, y = y, x % y\n    return a * b // x\n", "    return a * b\n",
          ((4, 6), (3, 5), (6, 6))),
        S("is_prime", "n", "Return True when n is a prime number.",
          "    if n < 2:\n        return False\n    k = 2\n"
          "    while k * k <= n:\n        if n % k == 0:\n            return False\n"
          "        k += 1\n    return True\n", "    return n % 2 == 1\n", ((7,), (9,), (1,), (2,), (97,))),
        S("second_largest", "numbers",
          "Return the second largest distinct value in numbers, or None when there are "
          "fewer than two distinct values.",
          "    values = sorted(set(numbers))\n    return values[-2] if len(values) >= 2 else None\n",
          "    return sorted(numbers)[-2] if len(numbers) >= 2 else None\n", (([3, 9, 9, 4],), ([5],), ([2, 2],), ([1, 2],))),
        S("mean_rounded_down", "numbers", "Return the mean of a non-empty list of integers, rounded down to an integer.",
          "    return sum(numbers) // len(numbers)\n", "    return sum(numbers) // (len(numbers) + 1)\n",
          (([2, 4, 9],), ([7],), ([-3, 0],))),
        S("running_total", "numbers", "Return the running totals: the i-th is the sum of the first i + 1 numbers.",
          "    total, out = 0, []\n    for x in numbers:\n"
          "        total += x\n        out.append(total)\n    return out\n",
          "    total, out = 0, []\n    for x in numbers:\n"
          "        out.append(total)\n        total += x\n    return out\n",
          (([1, 2, 3, 4],), ([],), ([5, -5],))),
        S("differences", "numbers", "Return the differences between each number and the one before it.",
          "    return [b - a for a, b in zip(numbers, numbers[1:])]\n", "    return [a - b for a, b in zip(numbers, numbers[1:])]\n",
          (([1, 4, 9, 16],), ([3],), ([],))),
        S("flatten", "lists", "Return one list holding the items of each inner list, in order.",
          "    return [x for inner in lists for x in inner]\n", "    return [inner[0] for inner in lists if inner]\n",
          (([[1, 2], [3], [], [4, 5]],), ([],))),
        S("unique_in_order", "items", "Return the items without repeats, each kept where it first appears.",
          "    seen, out = set(), []\n    for x in items:\n        if x not in seen:\n"
          "            seen.add(x)\n            out.append(x)\n    return out\n",
          "    return sorted(set(items))\n", (([3, 1, 3, 2, 1],), ([],), (["b", "a", "b"],))),
        S("most_common_letter", "text",
          "Return the lowercase letter that occurs most often in text (other characters do not count; "
          "a tie goes to the letter first in the alphabet). text holds at least one lowercase letter.",
          "    counts = {}\n    for ch in text:\n"
          "        if 'a' <= ch <= 'z':\n            counts[ch] = counts.get(ch, 0) + 1\n"
          "    return min(counts, key=lambda ch: (-counts[ch], ch))\n",
          "    return sorted(ch for ch in text if 'a' <= ch <= 'z')[0]\n", (("hello world",), ("abcabc b",), ("zz y",))),
        S("merge_sorted", "a, b", "Merge two sorted lists into one sorted list.",
          "    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
          "        if a[i] <= b[j]:\n            out.append(a[i])\n"
          "            i += 1\n        else:\n            out.append(b[j])\n"
          "            j += 1\n    return out + a[i:] + b[j:]\n",
          "    return a + b\n", (([1, 4, 6], [2, 3, 7]), ([], [1]), ([5], []))),
        S("acronym", "text", "Return the first letter of each space-separated word of text, in upper case.",
          "    return ''.join(w[0].upper() for w in text.split())\n", "    return ''.join(w[0] for w in text.split())\n",
          (("portable network graphics",), ("",), ("As Soon As Possible",))),
        S("longest_word", "text", "Return the longest space-separated word of text (the first of equally long ones; '' for an empty text).",
          "    best = ''\n    for word in text.split():\n"
          "        if len(word) > len(best):\n            best = word\n    return best\n",
          "    best = ''\n    for word in text.split():\n"
          "        if len(word) >= len(best):\n            best = word\n    return best\n",
          (("the quick brown fox",), ("",), ("a bb cc",))),
        S("shortest_word", "text",
          "Return the shortest space-separated word of text (the first of equally short ones). "
          "text holds at least one word.",
          "    return min(text.split(), key=len)\n", "    return min(text.split())\n", (("the quick brown fox",), ("zz a",))),
        S("swap_case", "text", "Return text with upper-case letters made lower case and lower-case letters made upper case.",
          "    return text.swapcase()\n", "    return text.upper()\n", (("Hello World",), ("",), ("abc",))),
        S("index_of_max", "numbers", "Return the index of the largest number (the first, when it occurs more than once). numbers is not empty.",
          "    return numbers.index(max(numbers))\n", "    return max(numbers)\n", (([3, 9, 2, 9],), ([5],), ([-1, -5],))),
        S("sum_of_squares", "numbers", "Return the sum of the squares of the numbers.",
          "    return sum(x * x for x in numbers)\n", "    return sum(numbers) ** 2\n", (([1, 2, 3],), ([],), ([-2],))),
        S("product", "numbers", "Return the product of the numbers (1 for an empty list).",
          "    result = 1\n    for x in numbers:\n        result *= x\n    return result\n",
          "    return numbers[0] * numbers[-1] if numbers else 0\n", (([2, 3, 4],), ([],), ([-5],))),
        S("range_sum", "a, b", "Return the sum of all the integers from a to b, both included (a <= b).",
          "    return sum(range(a, b + 1))\n", "    return sum(range(a, b))\n", ((1, 10), (5, 5), (-3, 3))),
        S("minutes_and_seconds", "seconds", "Split a number of seconds into a tuple (whole minutes, seconds left over).",
          "    return (seconds // 60, seconds % 60)\n", "    return (seconds // 60, seconds)\n", ((125,), (59,), (0,), (3600,))),
        S("has_digit", "text", "Return True when text holds at least one decimal digit.",
          "    return any(ch.isdigit() for ch in text)\n", "    return text[:1].isdigit()\n", (("abc1",), ("abc",), ("",), ("7up",))),
        S("is_sorted", "numbers", "Return True when each number is at least as large as the one before it.",
          "    return all(a <= b for a, b in zip(numbers, numbers[1:]))\n", "    return all(a < b for a, b in zip(numbers, numbers[1:]))\n",
          (([1, 2, 2, 5],), ([3, 1],), ([],))),
        S("all_positive", "numbers", "Return True when every number is greater than zero (True for an empty list).",
          "    return all(x > 0 for x in numbers)\n", "    return all(x >= 0 for x in numbers)\n", (([1, 2, 3],), ([1, 0, 2],), ([],))),
        S("count_even", "numbers", "Return how many of the numbers are even.",
          "    return sum(1 for x in numbers if x % 2 == 0)\n", "    return sum(1 for x in numbers if x % 2 == 1)\n",
          (([1, 2, 3, 4, 6],), ([],), ([0],))),
        S("sum_odd", "numbers", "Return the sum of the odd numbers in the list.",
          "    return sum(x for x in numbers if x % 2 == 1)\n", "    return sum(x for x in numbers if x % 2 == 0)\n",
          (([1, 2, 3, 4, 5],), ([],), ([-3, 2],))),
        S("double_each", "numbers", "Return a list with each number doubled.", "    return [2 * x for x in numbers]\n",
          "    return [x + 2 for x in numbers]\n", (([1, 2, 3],), ([],))),
        S("square_each", "numbers", "Return a list with each number squared.", "    return [x * x for x in numbers]\n",
          "    return [2 * x for x in numbers]\n", (([1, 2, 3, -4],), ([],))),
        S("negate_each", "numbers", "Return a list with the sign of each number flipped.", "    return [-x for x in numbers]\n",
          "    return [abs(x) for x in numbers]\n", (([1, -2, 0],), ([],))),
        S("absolute_values", "numbers", "Return a list of the absolute values of the numbers.", "    return [abs(x) for x in numbers]\n",
          "    return [-x for x in numbers]\n", (([1, -2, 0],), ([],))),
        S("letter_counts", "text",
          "Return a dict mapping each lowercase letter of text to how many times it occurs; "
          "other characters are not counted.",
          "    counts = {}\n    for ch in text:\n        if 'a' <= ch <= 'z':\n"
          "            counts[ch] = counts.get(ch, 0) + 1\n    return counts\n",
          "    counts = {}\n    for ch in text:\n        counts[ch] = counts.get(ch, 0) + 1\n    return counts\n",
          (("hello, world",), ("",), ("aAa",))),
        S("word_lengths", "text", "Return the length of each word of text; words are separated by runs of whitespace.",
          "    return [len(w) for w in text.split()]\n", "    return [len(w) for w in text.split(' ')]\n", (("to be  or not",), ("",))),
        S("count_words", "text", "Return how many words text holds; words are separated by runs of whitespace.",
          "    return len(text.split())\n", "    return text.count(' ') + 1\n", (("the cat sat",), ("",), ("a  b",))),
        S("initials", "name", "Return the initials of a name: the first letter of each word, in upper case, each followed by a dot.",
          "    return ''.join(w[0].upper() + '.' for w in name.split())\n", "    return '.'.join(w[0].upper() for w in name.split())\n",
          (("john ronald reuel tolkien",), ("ada",))),
        S("remove_vowels", "text", "Return text without its lowercase vowels (a, e, i, o, u).",
          "    return ''.join(ch for ch in text if ch not in 'aeiou')\n", "    return ''.join(ch for ch in text if ch not in 'aeio')\n",
          (("education",), ("",), ("sky",))),
        S("double_letters", "text", "Return text with every character written twice.", "    return ''.join(ch * 2 for ch in text)\n",
          "    return text * 2\n", (("abc",), ("",), ("x",))),
        S("interleave", "a, b", "Return the items of two lists taken in turn, a's first; what is left of the longer list goes at the end.",
          "    out = []\n    for i in range(max(len(a), len(b))):\n"
          "        if i < len(a):\n            out.append(a[i])\n"
          "        if i < len(b):\n            out.append(b[i])\n    return out\n",
          "    return [x for pair in zip(a, b) for x in pair]\n", (([1, 2, 3], ["a", "b"]), ([], [1]))),
        S("largest_gap", "numbers",
          "Return the largest difference between neighbours once the numbers are sorted "
          "(0 for fewer than two numbers).",
          "    values = sorted(numbers)\n    return max((b - a for a, b in zip(values, values[1:])), default=0)\n",
          "    return max(numbers) - min(numbers) if numbers else 0\n", (([1, 10, 3],), ([5],), ([],))),
        S("to_binary", "n", "Return n (n >= 0) written in base 2, without a prefix.", "    return bin(n)[2:]\n", "    return bin(n)\n",
          ((10,), (0,), (1,))),
        S("from_binary", "text", "Return the integer that text writes in base 2.", "    return int(text, 2)\n", "    return int(text)\n",
          (("1010",), ("0",), ("1",))),
        S("is_anagram", "a, b", "Return True when a and b hold the same characters, each the same number of times.",
          "    return sorted(a) == sorted(b)\n", "    return set(a) == set(b)\n", (("listen", "silent"), ("aab", "abb"), ("", ""))),
        S("count_upper", "text", "Return how many upper-case letters text holds.",
          "    return sum(1 for ch in text if ch.isupper())\n", "    return sum(1 for ch in text if ch.islower())\n",
          (("Hello World",), ("",))),
        S("middle_item", "items", "Return the middle item of a list of odd length.", "    return items[len(items) // 2]\n",
          "    return items[len(items) // 2 - 1]\n", (([1, 2, 3],), (["a"],), ([5, 6, 7, 8, 9],))),
        S("min_and_max", "numbers", "Return the tuple (smallest, largest) of a non-empty list of numbers.",
          "    return (min(numbers), max(numbers))\n", "    return (numbers[0], numbers[-1])\n", (([3, 1, 4, 1, 5],), ([7],))),
        S("pairs_to_dict", "keys, values", "Return a dict mapping each key to the value at the same position (the lists are equally long).",
          "    return dict(zip(keys, values))\n", "    return dict(zip(values, keys))\n", ((["a", "b"], [1, 2]), ([], []))),
        S("invert_dict", "mapping", "Return a dict mapping each value of mapping to its key (the values are all different).",
          "    return {v: k for k, v in mapping.items()}\n", "    return dict(mapping)\n", (({"a": 1, "b": 2},), ({},))),
        S("count_occurrences", "items, value", "Return how many of the items equal value.",
          "    return sum(1 for x in items if x == value)\n", "    return items.index(value) if value in items else 0\n",
          (([1, 2, 1, 1], 1), ([], 5), (["a", "b"], "b"))),
        S("triangle_number", "n", "Return 1 + 2 + ... + n (0 for n == 0).", "    return n * (n + 1) // 2\n",
          "    return n * (n - 1) // 2\n", ((4,), (0,), (1,), (10,))),
        S("digits_of", "n", "Return the decimal digits of n (n >= 0), most significant first.", "    return [int(d) for d in str(n)]\n",
          "    return [int(d) for d in reversed(str(n))]\n", ((1203,), (0,), (7,))),
        S("is_leap_year", "year",
          "Return True for a leap year of the Gregorian calendar: divisible by 4, except centuries, "
          "which must be divisible by 400.",
          "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)\n", "    return year % 4 == 0\n",
          ((2024,), (1900,), (2000,), (2023,))),
        S("celsius_to_fahrenheit", "celsius", "Convert a temperature in degrees Celsius (a multiple of 5) to degrees Fahrenheit, as an integer.",
          "    return celsius * 9 // 5 + 32\n", "    return celsius * 5 // 9 + 32\n", ((100,), (0,), (-40,), (35,))),
        S("parse_numbers", "text", "Return the integers that text writes, separated by spaces.",
          "    return [int(part) for part in text.split()]\n", "    return [int(ch) for ch in text if ch.isdigit()]\n",
          (("3 14 -2",), ("",))),
        S("join_with_commas", "items", "Return the strings joined by a comma and a space.", "    return ', '.join(items)\n",
          "    return ','.join(items)\n", ((["a", "b", "c"],), ([],), (["solo"],))),
    ]


def _call(source: str, entry_point: str, args: tuple[Any, ...]) -> Any:
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<{entry_point}>", "exec"), namespace)  # our own reference code, not a model's
    return namespace[entry_point](*copy.deepcopy(args))


def _code_prompt(spec: CodeSpec, example: Any) -> str:
    args = ", ".join(map(repr, spec.cases[0]))
    return (f"def {spec.entry_point}({spec.params}):\n    \"\"\"{spec.doc}\n\n"
            f"    >>> {spec.entry_point}({args})\n    {example!r}\n    \"\"\"\n")


def _code_record(task_id: str, spec: CodeSpec) -> dict[str, Any]:
    stub = f"def {spec.entry_point}({spec.params}):\n"
    expected = [_call(stub + spec.body, spec.entry_point, args) for args in spec.cases]
    wrong = []
    for args in spec.cases:
        try:
            wrong.append(_call(stub + spec.wrong, spec.entry_point, args))
        except Exception as e:  # a near miss may also crash on a case; that fails the test as well
            wrong.append(e)
    if all(type(w) is type(e) and w == e for w, e in zip(wrong, expected)):
        raise EvalsetBuildError(f"code task {spec.entry_point}: the wrong solution passes every case; add a case it fails")
    test = "def check(candidate):\n" + "".join(
        f"    assert candidate({', '.join(map(repr, args))}) == {value!r}\n" for args, value in zip(spec.cases, expected))
    return {"task_id": task_id, "prompt": _code_prompt(spec, expected[0]), "entry_point": spec.entry_point, "test": test,
            "canonical_solution": spec.body}


def code_items_with_wrong() -> list[tuple[dict[str, Any], str]]:
    """Every code item with a near-miss body its tests must fail (the tests of this module use it)."""
    out = []
    for hand in CODE_HAND:
        body, wrong = _CODE_HAND_SOLUTIONS[hand["entry_point"]]
        out.append(({**hand, "canonical_solution": body}, wrong))
    for spec in [*_param_families(), *_one_offs()]:
        out.append((_code_record(f"own/{len(out)}", spec), spec.wrong))
    return out


def code_items() -> list[dict[str, Any]]:
    return [record for record, _wrong in code_items_with_wrong()]


# ---------------------------------------------------------------------------------------------
# the files

BUILDERS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    BARD_CHOICE: bard_choice_items,
    BARD_SCHEMA: bard_schema_items,
    BARD_CLOZE: bard_cloze_items,
    BARD_ORDER: bard_order_items,
    BARD_AGREE: bard_agree_items,
    BARD_TURN: bard_turn_items,
    ARC_OWN: arc_items,
    BARD_LINE: bard_line_items,
    CODE_OWN: code_items,
}


def _check_unique(rel: str, items: list[dict[str, Any]]) -> None:
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        key = json.dumps({k: v for k, v in item.items() if k != "task_id"}, sort_keys=True)
        if key in seen:
            raise EvalsetBuildError(f"{rel}: item {i} repeats item {seen[key]}: {key[:120]}")
        seen[key] = i


def build_evalsets() -> dict[str, str]:
    """Each generated file's text, by its path under evalsets/: one JSON object per line."""
    out = {}
    for rel, build in BUILDERS.items():
        items = build()
        _check_unique(rel, items)
        out[rel] = "".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items)
    return out


def drifted(evalsets_dir: Path) -> list[str]:
    """The generated files under `evalsets_dir` that are missing or differ from the generator's output."""
    evalsets_dir = Path(evalsets_dir)
    return [rel for rel, text in build_evalsets().items()
            if not (evalsets_dir / rel).is_file() or (evalsets_dir / rel).read_text(encoding="utf-8") != text]


def write_evalsets(evalsets_dir: Path) -> list[str]:
    """Rewrite the generated files that differ (atomically, one by one); return their paths."""
    evalsets_dir = Path(evalsets_dir)
    changed = []
    for rel, text in build_evalsets().items():
        path = evalsets_dir / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_bytes_atomic(path, text.encode("utf-8"))
            changed.append(rel)
    return changed
