"""Examples packed apart into rows: whole, by best fit within a bounded window of a file.

A row holds `length` tokens (`data.tokens.context_length + 1`: inputs and shifted
targets). Packing "like text" joins every example into one stream and cuts
it into rows, so an example can straddle two rows and see the ones before
it. Packed apart (instruction data; text with `data.text.document_masks`),
each window of `WINDOW` consecutive examples of one file is placed into
rows by best fit decreasing: the longest first, each into the row whose free
space fits it most tightly, a new row where none does. An example is never
cut across rows, and the model keeps each to itself (`models.segments`: every
example ends with the end token). What is not whole:

- a text document longer than a row is split into pieces of a row each
  (the last piece, with its end token, is packed like any example): a
  document of any length trains, each piece apart, as Llama 3 trained with
  its document masks;
- an instruction example longer than a row is refused in one line naming
  its file and line, or, with `data.instructions.truncate`, cut to the row and trained
  alone in it (its end token lost, as TRL's `max_length` cuts).

The first token of every example weighs 0: it is no target of its own
example (the token before it is another example's). The rest of a row is
padding (token 0, weight 0), the share `padding` reports.

Windows never cross files, so the rows of a file are a function of its own
examples: counted once with its tokens (`token_counts`), they plan exactly-
once epochs and resume as any source's examples do, and a window bounds the
memory and the latency of the packing.
"""

import bisect
import dataclasses

import numpy as np

from tpu_keras.errors import UserError

WINDOW = 1024  # consecutive examples of a file packed together


@dataclasses.dataclass(frozen=True)
class Packing:
    """How a source's examples become rows: apart, `length` tokens a row."""

    length: int
    split_long: bool  # text: a long document becomes pieces of a row each
    truncate: bool    # instructions: a long example is cut to a row (else refused)

    def __str__(self) -> str:  # in the token counts' fingerprint: rows depend on all of it
        return f"apart({self.length}, window={WINDOW}, split={self.split_long}, truncate={self.truncate})"

    def pieces(self, sizes) -> list:
        """(example, start, size) of each piece the examples of `sizes` give, in order."""
        made = []
        for example, size in enumerate(int(n) for n in sizes):
            if size <= self.length:
                made.append((example, 0, size))
            elif self.split_long:
                made += [(example, start, min(self.length, size - start))
                         for start in range(0, size, self.length)]
            else:  # refused when counted (`longest`), so only truncation comes here
                made.append((example, 0, self.length))
        return made

    def rows(self, sizes) -> int:
        """How many rows the window of examples of `sizes` fills."""
        return len(_free_space(self, [size for _, _, size in self.pieces(sizes)])[1])

    def rows_of_file(self, sizes) -> int:
        """How many rows a file of examples of `sizes` (in its order) fills."""
        return sum(self.rows(sizes[start:start + WINDOW]) for start in range(0, len(sizes), WINDOW))

    def pack(self, sizes, columns: dict, pad: dict) -> dict:
        """The rows of one window: `columns` hold the window's examples' values one after
        another (`sizes` long each), as {name: array [tokens, ...]}; returns {name: array
        [rows, length, ...]}, padded with `pad`'s value for each name, and `mask` 0 at each
        example's first token."""
        pieces = self.pieces(sizes)
        where, free = _free_space(self, [size for _, _, size in pieces])
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        rows = {name: np.full((len(free), self.length) + values.shape[1:], pad[name], values.dtype)
                for name, values in columns.items()}
        for (example, start, size), (row, offset) in zip(pieces, where):
            source = slice(starts[example] + start, starts[example] + start + size)
            for name, values in columns.items():
                rows[name][row, offset:offset + size] = values[source]
            if "mask" in rows:
                rows["mask"][row, offset] = 0  # its first token: no target of its own example
        return rows


def _free_space(packing: Packing, sizes) -> tuple[list, list]:
    """Best fit decreasing: (row, offset) of each of `sizes`, in their order, and each row's
    free space. Ties go to the earlier row and the earlier piece, so the result is a
    function of `sizes` alone."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    free, open_rows, where = [], [], [None] * len(sizes)  # open_rows: sorted (free, row)
    for i in order:
        size = sizes[i]
        k = bisect.bisect_left(open_rows, (size, -1))
        if k == len(open_rows):
            row = len(free)
            free.append(packing.length)
        else:
            _, row = open_rows.pop(k)
        where[i] = (row, packing.length - free[row])
        free[row] -= size
        if free[row] > 0:
            bisect.insort(open_rows, (free[row], row))
    return where, free


def check_longest(path: str, line: int, tokens: int, packing: Packing) -> None:
    """A one-line error for an example longer than a row that may not be cut."""
    if tokens > packing.length and not (packing.split_long or packing.truncate):
        raise UserError(
            f"{path}:{line} is an example of {tokens} tokens, longer than a row of "
            f"data.tokens.context_length + 1 = {packing.length} tokens, and examples are packed whole; "
            f"raise data.tokens.context_length (and the model's context_length) to at least "
            f"{tokens - 1}, shorten that example, or set data.instructions.truncate=True to cut "
            "such examples to the row")
