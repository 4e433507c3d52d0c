"""vLLM's ``return_token_ids`` on completions and chat: the token ids alongside the text, as
RL and agent frameworks read them to train on exactly the tokens sampled (no re-tokenization).

Where vLLM puts them (its response models, vLLM >= 0.10.2):

* completions: each choice carries ``prompt_token_ids`` (its prompt's ids) and ``token_ids``
  (the ids generated for it); streamed, ``prompt_token_ids`` comes on each choice's first chunk
  and every chunk carries the ``token_ids`` generated since the last one.
* chat: the response carries ``prompt_token_ids`` (the rendered conversation's ids) at the top
  level and each choice its ``token_ids``; streamed, each choice's role chunk carries
  ``prompt_token_ids`` at the top level and the later chunks their choices' new ``token_ids``.

A streamed delta whose text is held back (a partial character, a possible stop string) sends no
chunk here; its ids ride on the choice's next chunk, so the chunks' ids always join into the
whole answer's.
"""

from __future__ import annotations


def add_to_answer(body: dict, kind: str, prompt_ids: list[list[int]], choice_ids: list[list[int]],
                  n: int) -> None:
    """The non-streamed ``body`` gets its ids (``choice_ids`` per choice, in index order; choice
    ``i`` answers prompt ``i // n``)."""
    if kind == "chat":
        body["prompt_token_ids"] = list(prompt_ids[0])
    for choice in body["choices"]:
        i = choice["index"]
        if kind == "completion":
            choice["prompt_token_ids"] = list(prompt_ids[i // n])
        choice["token_ids"] = list(choice_ids[i])


class StreamTokenIds:
    """Puts the ids on a stream's chunks: ``take(choice, ids)`` for each engine delta, then
    ``stamp(chunk)`` on each chunk, in order: a choice's ids since its last chunk go on its next."""

    def __init__(self, kind: str, prompt_ids: list[list[int]], n: int, n_choices: int):
        self.kind = kind
        self.prompt_ids = prompt_ids
        self.n = n
        self._pending: list[list[int]] = [[] for _ in range(n_choices)]
        self._prompt_sent = [False] * n_choices

    def take(self, choice: int, ids) -> None:
        self._pending[choice].extend(ids)

    def stamp(self, chunk: dict) -> dict:
        choice = chunk["choices"][0]
        i = choice["index"]
        if not self._prompt_sent[i]:
            self._prompt_sent[i] = True
            prompt = list(self.prompt_ids[i // self.n])
            if self.kind == "chat":
                chunk["prompt_token_ids"] = prompt
            else:
                choice["prompt_token_ids"] = prompt
        choice["token_ids"], self._pending[i] = self._pending[i], []
        return chunk
