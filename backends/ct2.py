"""Translating with a CTranslate2 model directory (backends/ct2_export.py wrote it).

    translator = CT2Translator.load("serve/", beam_size=4, alpha=0.6, threads=2)
    hyps = translator.translate(sources)   # a Translator, as LiveTranslator: ids in, ids out

The same contract as the JAX backends (search/translate.py): sources are
EOS-terminated id lists, results come back in input order with at most n_best
hypotheses each, best first, an empty source gets none. What CTranslate2 is told
so that it decodes as ours does (decoding.json):
- the source is passed as pieces without its EOS: the model's config appends it;
- decoding starts from <s> (the model's config) and never emits <pad>, <s> or an
  id the tokenizer lacks (`suppress_sequences`);
- a source of n tokens gets at most min(n + 50, max_len) output tokens, EOS
  included: sources are translated in groups of one limit, since CTranslate2
  takes one `max_decoding_length` per call (the Ding test's 1,000 sentences make
  41 groups of ~24). On a CPU the groups run side by side, one per core
  (`workers`: CTranslate2's inter_threads, one thread each), which beats one
  group at a time over all cores (intra_threads): small batches leave cores idle
  between matrix products. Where ours forces EOS at the limit,
  CTranslate2 stops the hypothesis without one: the tokens are the same, and
  such a hypothesis is scored again with EOS (`score_batch`) as ours is.
- scores rank by log P / len^alpha, len the tokens with EOS (our
  `--length_penalty=average`); its log P is over the tokens it may emit (the
  suppressed ones taken out before the softmax), ours over all of them: scores
  differ slightly on a trained model; beam search keeps 2K candidates per step and an
  EOS among the first K finishes a hypothesis, as ours. CTranslate2 stops a
  source once K hypotheses have finished: our `--stop=count` (the default `bound`
  goes on while a live beam could still win, so a few results differ).
"""

from __future__ import annotations

import collections
import json
import logging
import os
from collections.abc import Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from attention_jax.backends.ct2_export import (
    DECODING_JSON,
    DEVICES,
    FORMAT_VERSION,
    import_ctranslate2,
)
from attention_jax.data import read_versioned_json, tokenizer_names
from attention_jax.runtime.cpus import usable_cpus
from attention_jax.search.hypothesis import Hypothesis, IdLists, Indices, PerSource
from attention_jax.search.settings import CT2_BATCH_TOKENS, SearchSettings
from attention_jax.search.stages import Targets, check_lengths
from attention_jax.search.translate import Progress
from attention_jax.tokens import EOS_ID

_log = logging.getLogger(__name__)


def row_limit(source_length: int, extra: int, max_len: int) -> int:
    """Output tokens (EOS included) a source of `source_length` tokens may produce."""
    return min(source_length + extra, max_len)


def groups(lengths: Sequence[int], extra: int, max_len: int) -> list[tuple[int, list[int]]]:
    """(limit, indices) of the non-empty sources sharing each output limit, longest first."""
    by_limit: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        if n:
            by_limit.setdefault(row_limit(n, extra, max_len), []).append(i)
    return sorted(by_limit.items(), reverse=True)


class CT2Translator:
    """A CTranslate2 model directory as a `Backend`.

    Unlike an exported JAX translator, beam size, alpha and n_best are chosen at
    run time (the directory's decoding.json gives the defaults). CTranslate2 ranks by
    log P / len^alpha ("average") and stops a source on its own rule, short of the
    exact bound ("heuristic").
    """

    def __init__(
        self, directory: str, decoding: dict[str, Any], translator: Any, settings: SearchSettings
    ):
        self.directory, self.decoding, self._ct2 = directory, decoding, translator
        self.settings = settings.replace(length_penalty="average", stop="count")
        # Batches CTranslate2 runs at once (one per worker thread on a CPU).
        self.workers = translator.num_translators
        self.max_len = decoding["max_len"]
        self._extra = decoding["extra_decode_len"]
        with open(os.path.join(directory, "shared_vocabulary.json")) as f:
            self.vocab: list[str] = json.load(f)
        self._ids = {piece: i for i, piece in enumerate(self.vocab)}
        self._never = [[piece] for piece in decoding["never_generate"]]

    @classmethod
    def load(
        cls,
        directory: str,
        *,
        device: str = "cpu",
        threads: int = 0,
        search: Mapping[str, Any] | None = None,
    ) -> CT2Translator:
        """Open DIR (ValueError saying what is wrong; ImportError without ctranslate2).

        threads: CTranslate2's threads (0 = one per core this process may use); on a
          CPU each translates its own batch (`workers`); device: cpu or cuda.
        search: SearchSettings fields given (beam_size and alpha default to the
          directory's decoding.json, batch_tokens to CTranslate2's for the device;
          min_length is CTranslate2's min_decoding_length).
        """
        ct2 = import_ctranslate2()
        decoding = read_settings(directory)
        if device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
        if device == "cuda" and ct2.get_cuda_device_count() == 0:
            raise ValueError("--device=cuda: CTranslate2 sees no CUDA device here")
        if device == "cpu":  # batches side by side, one thread each
            workers, threads_each = threads if threads > 0 else usable_cpus(), 1
        else:  # one batch at a time over the GPU
            workers, threads_each = 1, threads
        try:
            translator = ct2.Translator(
                directory, device=device, inter_threads=workers, intra_threads=threads_each
            )
        except (RuntimeError, ValueError) as e:
            raise ValueError(f"CTranslate2 cannot load {directory}: {e}") from e
        if device == "cpu":
            batches = f"{workers} batches" if workers > 1 else "1 batch"
            _log.info(f"CTranslate2 on the CPU: {batches} at once, one thread each")
        return cls(directory, decoding, translator, cls.settings_for(decoding, device, search))

    @staticmethod
    def settings_for(
        decoding: dict[str, Any], device: str, search: Mapping[str, Any] | None
    ) -> SearchSettings:
        """The settings given (`search`), the directory's beam size and alpha and
        CTranslate2's batch size for `device` for the others; CTranslate2's length penalty
        and stop rule."""
        given = {k: v for k, v in (search or {}).items() if v is not None}
        defaults = dict(beam_size=decoding["beam_size"], alpha=decoding["alpha"])
        settings = SearchSettings(**{**defaults, "batch_tokens": CT2_BATCH_TOKENS[device], **given})
        return settings.replace(length_penalty="average", stop="count")

    def translate(
        self,
        sources: Sequence[Sequence[int]],
        progress: Progress | None = None,
        skip: Collection[int] = (),
        targets: Targets | None = None,
    ) -> list[list[Hypothesis]]:
        """EOS-terminated id lists -> per source its hypotheses, best first (input order);
        the sources `skip` get none. targets: prefixes (CTranslate2's target_prefix);
        ValueError for constraints, which CTranslate2 cannot honour."""
        check_lengths(sources, self.max_len)
        if targets is not None and targets.constraints is not None:
            raise ValueError(
                "CTranslate2 has no terminology constraints: translate with --workdir (or "
                "--marian) for --constraints"
            )
        if targets is not None:
            targets.check(sources, self.max_len)
        prefixes = targets.prefixes if targets is not None else None
        results: list[list[Hypothesis]] = [[] for _ in sources]
        skip = set(skip)
        todo = [i for i in range(len(sources)) if i not in skip]
        if prefixes is not None:
            prefixes = [prefixes[i] for i in todo]
        for rows, found in self._translate_groups([sources[i] for i in todo], prefixes):
            rows = [todo[r] for r in rows]
            for i, hyps in zip(rows, found, strict=True):
                results[i] = hyps
            if progress is not None:
                progress(rows, found)
        return results

    def score(
        self, sources: IdLists, given: IdLists, progress: Progress | None = None, skip: Indices = ()
    ) -> PerSource:
        """Given translations (EOS-terminated ids) scored by CTranslate2's `score_batch`:
        per pair [Hypothesis(tokens, log P(tokens + EOS | source), token_log_probs)], []
        for an empty source or one of `skip`. Pairs go in groups of about
        `batch_tokens` tokens, up to 2 x `workers` of them queued at once."""
        check_lengths(sources, self.max_len)
        check_lengths(given, self.max_len)
        results: list[list[Hypothesis]] = [[] for _ in sources]
        skip = set(skip)
        todo = [i for i, s in enumerate(sources) if len(s) and i not in skip]
        todo.sort(key=lambda i: -max(len(sources[i]), len(given[i])))  # similar lengths
        queued: collections.deque = collections.deque()

        def collect() -> None:
            rows, pending = queued.popleft()
            found = []
            for i, result in zip(rows, pending, strict=True):
                each = tuple(float(x) for x in result.result().log_probs)  # EOS's last
                tokens = list(given[i][:-1])
                results[i] = [Hypothesis(tokens, float(np.sum(each, dtype=np.float64)), None, each)]
                found.append(results[i])
            if progress is not None:
                progress(rows, found)

        for rows in _token_groups(todo, given, self.settings.tokens_per_batch):
            pending = self._ct2.score_batch(
                [self._pieces(sources[i]) for i in rows],
                [self._pieces(given[i]) for i in rows],
                max_batch_size=self.settings.tokens_per_batch,
                batch_type="tokens",
                max_input_length=0,  # both sides were cut to max_len already
                asynchronous=True,
            )
            queued.append((rows, pending))
            if len(queued) >= 2 * self.workers:
                collect()
        while queued:
            collect()
        return results

    def _translate_groups(
        self, sources: Sequence[Sequence[int]], prefixes: Sequence[Sequence[int]] | None
    ) -> Iterator[tuple[list[int], list[list[Hypothesis]]]]:
        """(rows, their hypotheses) per group of one output limit, longest first.

        Up to 2 x `workers` groups are queued at once (asynchronous calls), so every
        worker has a next batch while the results of one are collected and rescored.
        """
        queued: collections.deque = collections.deque()
        for limit, rows in groups([len(s) for s in sources], self._extra, self.max_len):
            pieces = [self._pieces(sources[i]) for i in rows]
            starts = (
                None if prefixes is None else [[self.vocab[t] for t in prefixes[i]] for i in rows]
            )
            # Ours forces EOS as the limit-th token, so limit - 1 tokens before it.
            most = max(limit - 1, 1)
            queued.append((rows, pieces, starts, most, self._submit(pieces, starts, most)))
            if len(queued) >= 2 * self.workers:
                yield self._collect(*queued.popleft())
        while queued:
            yield self._collect(*queued.popleft())

    def _submit(
        self, pieces: list[list[str]], starts: list[list[str]] | None, most: int
    ) -> list[Any]:
        """One group's translation of at most `most` tokens a hypothesis (starting with
        `starts`, if given), started: CTranslate2's asynchronous results."""
        s = self.settings
        return self._ct2.translate_batch(
            pieces,
            starts,
            beam_size=s.beam_size,
            length_penalty=s.alpha,
            # all K: those cut by the limit rank again once scored with EOS (`_at_limit`)
            num_hypotheses=s.beam_size,
            max_decoding_length=most,
            min_decoding_length=s.min_length,
            max_input_length=0,  # sources were cut to max_len already
            max_batch_size=s.tokens_per_batch,
            batch_type="tokens",
            return_scores=True,
            suppress_sequences=self._never,
            asynchronous=True,
        )

    def _collect(
        self,
        rows: list[int],
        pieces: list[list[str]],
        starts: list[list[str]] | None,
        most: int,
        pending: list[Any],
    ) -> tuple[list[int], list[list[Hypothesis]]]:
        """Wait for a group's results: its rows and their hypotheses, best first."""
        hyps = [self._hypotheses(r.result()) for r in pending]
        n = self.settings.n_best
        ranked = self._at_limit(hyps, pieces, starts, most)
        return rows, [found[:n] for found in ranked]

    def _pieces(self, ids: Sequence[int]) -> list[str]:
        """A source's ids -> its pieces, without the EOS that CTranslate2 appends."""
        ids = list(ids)
        if ids and ids[-1] == EOS_ID:
            ids.pop()
        return [self.vocab[i] for i in ids]

    def _hypotheses(self, result: Any) -> list[Hypothesis]:
        out = []
        for tokens, score in zip(result.hypotheses, result.scores, strict=True):
            if np.isfinite(score):
                out.append(Hypothesis([self._ids[t] for t in tokens], float(score)))
        return out

    def _at_limit(
        self,
        hyps: list[list[Hypothesis]],
        pieces: list[list[str]],
        starts: list[list[str]] | None,
        most: int,
    ) -> list[list[Hypothesis]]:
        """Hypotheses of `most` tokens, cut by the length limit, scored as ours scores them:
        with the EOS that ours forces at the limit (its log-probability counts; CTranslate2
        stops them without one), which may move them down below others that ended. Each
        source's hypotheses re-sorted, best first."""
        cut = [(r, h) for r, found in enumerate(hyps) for h, x in enumerate(found)
               if len(x.tokens) >= most]  # fmt: skip
        if not cut:
            return hyps
        scored = self._ct2.score_batch(
            [pieces[r] for r, _ in cut],
            [[self.vocab[t] for t in hyps[r][h].tokens] for r, h in cut],
            max_batch_size=self.settings.tokens_per_batch,
            batch_type="tokens",
            max_input_length=0,
        )
        for (r, h), result in zip(cut, scored, strict=True):
            length = len(result.log_probs)  # EOS included; a prefix too, outside the score
            logp = float(np.sum(result.log_probs[len(starts[r]) if starts else 0 :]))
            hyps[r][h] = Hypothesis(hyps[r][h].tokens, logp / length**self.settings.alpha)
        return [sorted(found, key=lambda x: -x.score) for found in hyps]


def _token_groups(
    rows: Sequence[int], given: Sequence[Sequence[int]], tokens: int
) -> Iterator[list[int]]:
    """`rows` in order, cut into groups of about `tokens` target tokens (at least one row)."""
    group: list[int] = []
    count = 0
    for i in rows:
        if group and count + len(given[i]) > tokens:
            yield group
            group, count = [], 0
        group.append(i)
        count += len(given[i])
    if group:
        yield group


def read_settings(directory: str) -> dict[str, Any]:
    """decoding.json of a directory `decode.py --export_ct2` wrote (ValueError otherwise)."""
    writer = "decode.py --workdir=W --export_ct2=DIR"
    settings = read_versioned_json(directory, DECODING_JSON, FORMAT_VERSION, writer)
    for name in ("model.bin", "shared_vocabulary.json", *tokenizer_names(directory)):
        if not os.path.isfile(os.path.join(directory, name)):
            raise ValueError(f"{directory}/{name} is missing; export the model again")
    return settings
