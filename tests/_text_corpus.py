"""A small mixed corpus for training tokenizers in tests: prose, verse, a word problem, code,
accented text, emoji and CJK."""

CORPUS = [
    "The quick brown fox jumps over the lazy dog. 12345 + 678 = 13023\n",
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.\n",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
    "Héllo wörld — ünïcödé text, emoji 🙂 and CJK 漢字 too.\n",
] * 4
