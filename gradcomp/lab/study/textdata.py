"""``text-gpt``'s data: a character-level language-modelling split of a text file.

The vocabulary is the sorted set of the file's distinct characters (UTF-8).
The first ``1 - test_fraction`` of the characters train, the rest test. A
training sample is the window of :data:`BLOCK` characters starting at any
offset of the training part (targets: the same window shifted by one
character), so an epoch visits every offset once in the study's data order;
the test split is the non-overlapping windows of the test part (at most
:data:`MAX_TEST_WINDOWS`), the same for every run.
"""

from __future__ import annotations

import os

import torch

from gradcomp.lab.study.splits import Split

__all__ = ["load_text_split", "TokenWindows", "BLOCK", "MAX_TEST_WINDOWS"]

#: Context length (characters) of ``text-gpt``.
BLOCK = 64
#: Most test windows evaluated (64 x 256 = 16,384 characters).
MAX_TEST_WINDOWS = 256


class TokenWindows:
    """Windows of ``block`` token ids from ``tokens`` starting at ``offsets + shift``;
    ``w[idx]`` (int64 index tensor or slice) is int64 ``(len(idx), block)``.

    Args:
        tokens: int64 ``(n,)``; offsets: int64 ``(m,)`` with ``offset + shift + block <= n``;
        shift: 0 for inputs, 1 for next-token targets.
    """

    def __init__(self, tokens: torch.Tensor, offsets: torch.Tensor, block: int, shift: int = 0):
        if len(offsets) and int(offsets.max()) + shift + block > len(tokens):
            raise ValueError("a window runs past the end of the tokens")
        self.tokens, self.offsets, self.block, self.shift = tokens, offsets, block, shift
        self._span = torch.arange(block) + shift

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.offsets), self.block)

    def __getitem__(self, idx) -> torch.Tensor:
        return self.tokens[self.offsets[idx].reshape(-1, 1) + self._span]


def load_text_split(path: str, test_fraction: float = 0.1, block: int = BLOCK) -> Split:
    """Split the text file at ``path`` (see the module docstring).

    Returns:
        A :class:`Split`: ``x_*`` / ``y_*`` :class:`TokenWindows` of int64
        ``(n, block)`` ids in ``0..vocab-1``; ``num_classes`` the vocabulary
        size, ``block`` the context; ``info["vocab"]`` the characters in id order.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: ``test_fraction`` outside (0, 1); a file that is not UTF-8
            text, or too short for one training and one test window.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--data-file {path}: no such file (give a UTF-8 text file)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ValueError(f"--data-file {path} is not UTF-8 text: {e}") from None
    vocab = sorted(set(text))
    ids = {ch: i for i, ch in enumerate(vocab)}
    tokens = torch.tensor([ids[ch] for ch in text], dtype=torch.int64)
    cut = int(len(tokens) * (1.0 - test_fraction))
    train, test = tokens[:cut], tokens[cut:]
    if len(train) < block + 2 or len(test) < block + 1:
        need = int((block + 2) / min(test_fraction, 1 - test_fraction)) + 1
        raise ValueError(f"--data-file {path} has {len(tokens)} characters: too short for "
                         f"{block}-character windows in both splits (at least ~{need} needed)")
    tr_off = torch.arange(len(train) - block)
    te_off = torch.arange(0, len(test) - block, block)[:MAX_TEST_WINDOWS]
    return Split(TokenWindows(train, tr_off, block), TokenWindows(train, tr_off, block, 1),
                 TokenWindows(test, te_off, block), TokenWindows(test, te_off, block, 1),
                 num_features=block, num_classes=len(vocab), block=block,
                 info={"name": f"text {os.path.basename(path)}", "characters": len(tokens),
                       "vocab": "".join(vocab)})
