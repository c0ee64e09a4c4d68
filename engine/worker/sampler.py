"""Batched sampling: banned tokens, penalties, greedy, temperature, top-k/top-p/min-p, logprobs.

The model runner builds one `SamplingMetadata` per step (one row per request that samples) and
calls `Sampler()(logits, meta)`. Every per-row transform is row-local and is an exact identity
for a row whose parameter is at its default, so a row's token never depends on which other
rows share the batch. Seeded rows draw their noise from a generator keyed by (seed, position),
so a request samples the same tokens after preemption or in any batch.

A row whose logits are not finite once processed (a NaN, a +inf, or no token left that is not
-inf: an fp16 overflow in the model, a penalty past what float32 holds) samples no token: it
gets NONFINITE, and the model runner fails that request alone. One reduction per row, read back
with the tokens (no extra device sync).
"""

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

_SEED_MASK = (1 << 63) - 1
NONFINITE = -1  # a row's token when its logits were not finite (no token is sampled for it)
NONFINITE_ERROR = ("non-finite logits: the model's scores for this request, with its sampling parameters "
                   "applied, held NaN or inf (a numeric overflow); no token could be sampled")


def generator_seed(seed: int, position: int) -> int:
    # position = number of tokens the request has generated so far; independent of batching.
    return (seed * 1_000_003 + position) & _SEED_MASK


@dataclass(slots=True)
class PenaltyMetadata:
    # Only rows with a non-default penalty contribute token ids; the other rows get
    # penalty 1.0 / 0.0 / 0.0, which leaves their logits bit-for-bit unchanged.
    repetition: torch.Tensor  # [num_rows] float32
    frequency: torch.Tensor  # [num_rows] float32
    presence: torch.Tensor  # [num_rows] float32
    prompt_index: tuple[torch.Tensor, torch.Tensor]  # (rows, token ids) of prompt tokens
    output_index: tuple[torch.Tensor, torch.Tensor]  # (rows, token ids), repeats kept for counts


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    all_greedy: bool
    greedy_mask: torch.Tensor | None  # [num_rows] bool; only when greedy and random rows mix
    # The tensors below are None when no random row needs the transform; otherwise rows that
    # don't use it (greedy rows included) hold the value that makes it an identity.
    temperature: torch.Tensor | None  # [num_rows] float32
    top_k: torch.Tensor | None  # [num_rows] int64; 0 means off, as in SamplingParams
    top_p: torch.Tensor | None  # [num_rows] float32
    min_p: torch.Tensor | None  # [num_rows] float32
    seeded_rows: list[tuple[int, int]]  # (row, generator seed) for random rows with a seed
    needs_global_noise: bool  # some random row has no seed
    banned_index: tuple[torch.Tensor, torch.Tensor] | None  # (rows, token ids) to set to -inf
    penalties: PenaltyMetadata | None
    num_logprobs: list[int | None]  # per row: SamplingParams.logprobs
    max_num_logprobs: int | None  # None when no row asked for logprobs
    # Structured output: (rows, [len(rows), vocab] float32 upper bound: +inf for the tokens
    # their grammars allow, -inf for the rest).
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        banned_token_ids: list[list[int]] | None,
        device: torch.device,
        grammar: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> "SamplingMetadata":
        num_rows = len(params)
        if len(prompt_token_ids) != num_rows or len(output_token_ids) != num_rows:
            raise ValueError("params, prompt_token_ids and output_token_ids must have one entry per row")
        if banned_token_ids is not None and len(banned_token_ids) != num_rows:
            raise ValueError("banned_token_ids must have one entry per row")

        greedy = [p.is_greedy for p in params]
        num_random = greedy.count(False)

        def column(name: str, identity: float, dtype: torch.dtype) -> torch.Tensor | None:
            # Greedy rows hold the identity value: their token is the argmax regardless.
            values = [identity if g else getattr(p, name) for p, g in zip(params, greedy)]
            if all(v == identity for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        seeded_rows = [
            (i, generator_seed(p.seed, len(out)))
            for i, (p, g, out) in enumerate(zip(params, greedy, output_token_ids))
            if not g and p.seed is not None
        ]
        requested = [p.logprobs for p in params if p.logprobs is not None]
        mixed = 0 < num_random < num_rows
        banned = banned_token_ids is not None and any(banned_token_ids)
        return cls(
            num_rows=num_rows,
            all_greedy=num_random == 0,
            greedy_mask=torch.tensor(greedy, dtype=torch.bool, device=device) if mixed else None,
            temperature=column("temperature", 1.0, torch.float32),
            top_k=column("top_k", 0, torch.int64),
            top_p=column("top_p", 1.0, torch.float32),
            min_p=column("min_p", 0.0, torch.float32),
            seeded_rows=seeded_rows,
            needs_global_noise=len(seeded_rows) < num_random,
            banned_index=_flat_index(banned_token_ids, device) if banned else None,
            penalties=_build_penalties(params, prompt_token_ids, output_token_ids, device),
            num_logprobs=[p.logprobs for p in params],
            max_num_logprobs=max(requested) if requested else None,
            grammar=grammar,
        )


def _flat_index(token_ids: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # (rows, token ids) of every listed token, ready for index_put on a [num_rows, vocab] tensor.
    rows = [i for i, ids in enumerate(token_ids) for _ in ids]
    cols = [t for ids in token_ids for t in ids]
    return (
        torch.tensor(rows, dtype=torch.int64, device=device),
        torch.tensor(cols, dtype=torch.int64, device=device),
    )


def _build_penalties(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    device: torch.device,
) -> PenaltyMetadata | None:
    used = [
        p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params
    ]
    if not any(used):
        return None
    # Repetition looks at prompt and output tokens; only penalised rows pay for the flattening.
    prompts = [ids if u else [] for ids, u in zip(prompt_token_ids, used)]
    outputs = [ids if u else [] for ids, u in zip(output_token_ids, used)]
    return PenaltyMetadata(
        repetition=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device),
        frequency=torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32, device=device),
        presence=torch.tensor([p.presence_penalty for p in params], dtype=torch.float32, device=device),
        prompt_index=_flat_index(prompts, device),
        output_index=_flat_index(outputs, device),
    )


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: list[int]  # one per row; NONFINITE for a row whose logits were not finite
    # Per row: [(token id, logprob, rank)], the sampled token first, then the row's top
    # `logprobs` tokens in descending order; [] for rows that did not ask. None when no row asked.
    logprobs: list[list[tuple[int, float, int]]] | None


def apply_penalties(logits: torch.Tensor, pen: PenaltyMetadata) -> torch.Tensor:
    """vLLM's penalties, out of place: repetition over prompt and output tokens (positive logits
    divided, negative multiplied), then frequency * count and presence * seen over output tokens."""
    # logits: [num_rows, vocab]
    counts = torch.zeros_like(logits).index_put_(
        pen.output_index, torch.ones_like(pen.output_index[0], dtype=logits.dtype), accumulate=True
    )
    output_seen = counts > 0
    in_prompt = torch.zeros_like(output_seen).index_put_(
        pen.prompt_index, torch.tensor(True, device=logits.device)
    )
    seen = in_prompt | output_seen
    rep = torch.where(seen, pen.repetition.unsqueeze(1), 1.0)
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - pen.frequency.unsqueeze(1) * counts
    return logits - pen.presence.unsqueeze(1) * output_seen


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Masks to -inf what top-k and then top-p (over the top-k survivors) remove. Ties with the
    k-th value are kept, and the most likely token always survives."""
    # Ascending sort: the k-th largest value sits at vocab - k; top-p drops a prefix.
    sorted_logits, order = logits.sort(dim=-1)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = top_k.masked_fill(top_k == 0, vocab).clamp(max=vocab)  # 0 (off) keeps the whole vocab
        kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the least likely tokens whose total mass stays within 1 - p. For p = 1 this drops
        # only tokens of probability exactly 0, so unfiltered rows sample exactly as before.
        drop = cum_probs <= 1 - top_p.unsqueeze(1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits)


def apply_grammar_bound(logits: torch.Tensor, rows: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Out of place: the listed rows keep only the tokens their grammars allow; min(x, +inf) is
    exactly x, so allowed tokens and the other rows are untouched."""
    if rows.numel() == logits.shape[0]:  # every row is constrained (rows come in ascending order)
        return torch.minimum(logits, bound)
    return logits.index_copy(0, rows, torch.minimum(logits[rows], bound))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); min_p = 0 keeps everything.
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _max_first_of_ties(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(row max, index of its first occurrence). On the CPU max()'s indices are the first of
    ties; CUDA's max() promises no particular one (so P->D and batch equality could break at an
    exact tie), while argmax() returns the first there."""
    if logits.device.type == "cpu":
        return logits.max(dim=-1)
    return logits.amax(dim=-1), logits.argmax(dim=-1)


class Sampler:
    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        # logits: [num_rows, vocab] in the model's dtype; never modified in place (the caller may reuse it).
        if (meta.all_greedy and meta.grammar is None and meta.banned_index is None and meta.penalties is None
                and meta.max_num_logprobs is None):
            # Widening to float32 is exact and monotone, so the argmax (first of ties) is the same
            # in the model's dtype: no [rows, vocab] float copy for a plain greedy batch. max()'s
            # indices are argmax's (first of ties, NaN wins) and its CPU kernel is vectorized for
            # bf16/fp16, where argmax's is not (2.7 of a 32 ms bf16 decode step, 32 rows). Its
            # values say whether the row is finite: NaN and +inf win, -inf is the max only when
            # every token is -inf.
            values, indices = _max_first_of_ties(logits)
            return SamplerOutput(torch.where(values.isfinite(), indices, NONFINITE).tolist(), None)
        raw = logits.float()
        logits = raw
        if meta.grammar is not None:
            logits = apply_grammar_bound(logits, *meta.grammar)
        if meta.banned_index is not None:
            banned = logits.index_put(meta.banned_index, torch.tensor(float("-inf"), device=logits.device))
            if meta.grammar is not None:
                # A grammar that allows only banned tokens (EOS before min_tokens) wins: its
                # output must stay valid.
                emptied = banned.isneginf().all(dim=-1, keepdim=True)
                banned = torch.where(emptied, logits, banned)
            logits = banned
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)

        # Finite rows have a finite max: a NaN or +inf anywhere wins it, and -inf (a ban, a
        # grammar's mask) is the max only of a row with nothing left to sample.
        if meta.all_greedy:
            row_max, sampled = _max_first_of_ties(logits)
        else:
            row_max = logits.amax(dim=-1)
            sampled = self._sample(logits, meta)
            if meta.greedy_mask is not None:
                sampled = torch.where(meta.greedy_mask, logits.argmax(dim=-1), sampled)

        token_ids = torch.where(row_max.isfinite(), sampled, NONFINITE).tolist()
        if meta.max_num_logprobs is None:
            return SamplerOutput(token_ids, None)
        return SamplerOutput(token_ids, _gather_logprobs(raw, sampled, meta))

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.temperature is not None:
            logits = logits / meta.temperature.unsqueeze(1)
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        probs = logits.softmax(dim=-1)

        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) draws i with probability p_i.
        # Greedy rows in a mixed batch get ones: their token is replaced by the argmax anyway.
        noise = torch.empty_like(probs).exponential_() if meta.needs_global_noise else torch.ones_like(probs)
        if meta.seeded_rows:
            gen = _seeded_generator(probs.device)
            for row, seed in meta.seeded_rows:
                gen.manual_seed(seed)  # reseeded per row: its draw depends on (seed, position) alone
                noise[row].exponential_(generator=gen)  # a view: fills the row in place
        # A zero draw would give 0 / 0 = nan for filtered tokens.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        return probs.div(noise).argmax(dim=-1)


_GENERATORS: dict[torch.device, torch.Generator] = {}


def _seeded_generator(device: torch.device) -> torch.Generator:
    """One generator per device, reseeded for every seeded row (creating one per row per step
    costs an allocation on CUDA each time)."""
    gen = _GENERATORS.get(device)
    if gen is None:
        gen = _GENERATORS[device] = torch.Generator(device=device)
    return gen


def _gather_logprobs(
    raw: torch.Tensor, sampled: torch.Tensor, meta: SamplingMetadata
) -> list[list[tuple[int, float, int]]]:
    entries = logprob_entries(raw, sampled, meta.max_num_logprobs)
    return [[] if n is None else entries[i][: n + 1] for i, n in enumerate(meta.num_logprobs)]


def logprob_entries(raw: torch.Tensor, chosen: torch.Tensor, k: int) -> list[list[tuple[int, float, int]]]:
    """Per row of logits: [(token id, logprob, rank)] for the row's chosen token (the sampled
    one, or a prompt's next token) first, then the top k in descending order."""
    # Logprobs describe the model's distribution: raw logits, before bans, penalties or temperature.
    logprobs = torch.log_softmax(raw.float(), dim=-1)  # [num_rows, vocab]
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))  # [num_rows, 1]
    chosen_rank = (logprobs > chosen_lp).sum(dim=-1, keepdim=True) + 1
    top_lp, top_ids = logprobs.topk(k, dim=-1)  # [num_rows, k], descending
    # Anything strictly above a top-k value is itself in the top k, so ranks need only the top k.
    top_rank = (top_lp.unsqueeze(1) > top_lp.unsqueeze(2)).sum(dim=-1) + 1

    # Column 0 is the chosen token, then the top k; one device-to-host copy per tensor.
    ids = torch.cat([chosen.unsqueeze(1), top_ids], dim=1).tolist()  # [num_rows, 1 + k]
    values = torch.cat([chosen_lp, top_lp], dim=1).tolist()
    ranks = torch.cat([chosen_rank, top_rank], dim=1).tolist()
    return [list(zip(i, v, r)) for i, v, r in zip(ids, values, ranks)]
