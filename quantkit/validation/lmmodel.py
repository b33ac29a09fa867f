"""quantkit's streaming reference forward as an lm-evaluation-harness model (`--model quantkit`).

lm-eval asks a model three things: the log-likelihood of a continuation after a context, the rolling
log-likelihood of a whole text, and greedy text until a stop string. Here each is answered by
quantkit.validation.forward.step over a checkpoint folder, one decoder layer at a time, so a task
runs on a trillion-parameter checkpoint in one layer's memory. A pass over the layers is expensive
(every layer read or held), so requests are batched: every request of a pass is its own stream
(sequences of one length share a (B, T) tensor, no padding, so no attention mask is needed), and
`step` loads each layer once for all of them. A pass takes as many sequences as `batch_bytes` of
activations allows (quantkit.planner.taskcost.activation_bytes; quantkit.validation.tasks sizes it to the memory budget). Greedy generation runs every request of a
pass in lockstep, one token per pass, on the incremental MLA/DSA caches validate's decode rows use.

The tokenization (context/continuation split, empty context, rolling windows, stop strings) is
lm-eval's own TemplateLM and HFLM logic, so the same task gives the same requests as lm-eval's `hf`
model: tests/validation/test_tasks.py holds the scores to that.

This module imports lm_eval at the top: import it only through quantkit.validation.tasks, which says
how to install lm-eval when it is missing.
"""

from __future__ import annotations

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from quantkit.checkpoint.reader import Checkpoint
from quantkit.planner.taskcost import activation_bytes
from quantkit.runtime.device import resolve_device
from quantkit.validation.forward import Stream, heads, new_caches, step

DEFAULT_BATCH_BYTES = 2 << 30


@register_model("quantkit")
class QuantkitLM(TemplateLM):
    """A checkpoint folder run by quantkit's reference forward. `kv` simulates a KV cache dtype
    (quantkit.model.kvcache.KVCache) on the generation path; `options` go to the reference Context."""

    def __init__(self, pretrained: str | Checkpoint, tokenizer=None, device: str = "auto", dtype: torch.dtype = torch.float32,
                 batch_bytes: int = DEFAULT_BATCH_BYTES, chunk: int = 16, kv=None, max_length: int | None = None,
                 progress=None, **options):
        super().__init__()
        from transformers import AutoTokenizer

        self.ckpt = pretrained if isinstance(pretrained, Checkpoint) else Checkpoint(pretrained)
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer or self.ckpt.folder))
        self._device = resolve_device(device)
        self.dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
        self.batch_bytes, self.chunk, self.kv, self.options = int(batch_bytes), int(chunk), kv, options
        self.progress = progress  # called with the number of layer loads of each pass
        self._max_length = int(max_length or self.ckpt.arch.max_position_embeddings)
        self.passes = 0  # forward passes over the layers (the cost planner's unit)
        self.tokens_generated = 0

    # ---- what TemplateLM needs --------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """lm-eval's HF model's: BOS when the tokenizer has one, else EOS (the context of an empty context)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self):
        return self._device

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return self.tokenizer.encode(string, **extra)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ---- the forward passes -----------------------------------------------------------------------
    def _passes(self, seqs: list[list[int]], conts: list[list[int]]) -> list[tuple[float, bool]]:
        """(sum of log p(cont), cont is greedy) for each sequence whose last len(cont) positions predict
        `cont`, in as few passes over the layers as `batch_bytes` allows. Reduced on the device right
        after each pass: only those positions go through the head, nothing (T, V)-sized is kept."""
        order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
        out: list[tuple[float, bool] | None] = [None] * len(seqs)
        batch: list[int] = []
        used = 0
        for i in order + [None]:
            cost = 0 if i is None else activation_bytes(self.ckpt.arch, len(seqs[i]))
            if i is not None and (not batch or used + cost <= self.batch_bytes):
                batch.append(i)
                used += cost
                continue
            by_len: dict[int, list[int]] = {}
            for j in batch:
                by_len.setdefault(len(seqs[j]), []).append(j)
            streams = [Stream(f"len{n}", "m", None, ids=torch.tensor([seqs[j] for j in js]), kv=self.kv, options=self.options)
                       for n, js in by_len.items()]
            tails = [max(len(conts[j]) for j in js) for js in by_len.values()]
            for js, logits in zip(by_len.values(), self._run(streams, tails)):
                for j, row in zip(js, logits):  # row (tail, V)
                    lp = torch.log_softmax(row[-len(conts[j]):].float(), dim=-1)  # (C, V): the positions that predict cont
                    target = torch.tensor(conts[j], device=lp.device)
                    out[j] = (float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
            batch, used = ([], 0) if i is None else ([i], cost)
        return out

    def _run(self, streams: list[Stream], tails: list[int]) -> list[torch.Tensor]:
        """One pass over the layers for every stream; each one's logits at its last `tails[k]` positions,
        (B, tail, V), left on the device."""
        with torch.no_grad():
            step({"m": self.ckpt}, streams, self._device, self.dtype, chunk=self.chunk)
            logits = heads(self.ckpt, [s.h[:, -t:] for s, t in zip(streams, tails)], self.dtype)
        self.passes += 1
        if self.progress:
            self.progress(self.ckpt.arch.num_hidden_layers)
        return logits

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log p(continuation), whether it is the greedy continuation) per request, as lm-eval's HF
        model computes them: the input is context + continuation less its last token, left-truncated to
        max_length."""
        seqs, conts = [], []
        for _, context_enc, continuation_enc in requests:
            seqs.append((context_enc + continuation_enc)[-(self.max_length + 1):][:-1])
            conts.append(continuation_enc)
        return self._passes(seqs, conts)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood in max_length windows (lm-eval's rolling windows, as its HF model)."""
        windows, owner = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            for w in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                    context_len=1)):
                windows.append((None, *w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += ll
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy text until a stop string, EOS or max_gen_toks; one pass over the layers per token for all
        requests with the same generation settings. Sampling is refused: a delta must be between greedy runs."""
        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        out: list[str | None] = [None] * len(requests)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        for idx in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[idx[0]].args[1]), 256)
            if kwargs.get("do_sample"):
                raise ValueError("quantkit's model generates greedily only (do_sample: false)")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            n = kwargs.pop("max_gen_toks")
            contexts = [self.tok_encode(requests[i].args[0])[-(self.max_length - n):] for i in idx]
            budget = max(self.batch_bytes // activation_bytes(self.ckpt.arch, max(len(c) + n for c in contexts)), 1)
            for start in range(0, len(idx), budget):
                part = idx[start:start + budget]
                for i, toks in zip(part, self._greedy(contexts[start:start + budget], n, until)):
                    out[i] = postprocess_generated_text(self.tok_decode(toks), until, None)
        return out

    def _greedy(self, contexts: list[list[int]], n: int, until: list[str]) -> list[list[int]]:
        """Up to `n` greedy tokens after each context, all contexts in lockstep (one stream each, with caches)."""
        streams = [Stream(f"g{i}", "m", new_caches(self.ckpt), ids=torch.tensor([c]), kv=self.kv, options=self.options)
                   for i, c in enumerate(contexts)]
        gen: list[list[int]] = [[] for _ in contexts]
        live = list(range(len(contexts)))
        while live:
            logits = self._run([streams[i] for i in live], [1] * len(live))
            still = []
            for i, lg in zip(live, logits):
                tok = int(lg[0, -1].argmax())
                gen[i].append(tok)
                self.tokens_generated += 1
                text = self.tok_decode(gen[i])
                if tok != self.eot_token_id and len(gen[i]) < n and not any(u and u in text for u in until):
                    streams[i].ids = torch.tensor([[tok]])
                    still.append(i)
            live = still
        return gen
