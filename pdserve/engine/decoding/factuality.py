"""Factuality decoding rules that contrast the final layer with earlier ones, over a batch of rows.

DoLa (Chuang et al., ICLR 2024, "Decoding by Contrasting Layers"), as its authors' code and
transformers' `_dola_decoding` compute it: per row, the premature layer is the candidate whose
next-token distribution diverges most from the final one — 0.5 * (KL(M || p_final) +
KL(M || p_layer)) averaged over the vocabulary, M the mean of the two distributions (what that
code calls the JSD; ties go to the lowest layer). Then the adaptive plausibility constraint keeps
the tokens whose final-layer log-probability is within log(alpha) of the best (alpha = 0.1), and
their scores are log p_final - log p_premature; every other token gets -inf.

SLED (Zhang et al., NeurIPS 2024, "Self Logits Evolution Decoding", Algorithm 1, as the
authors' `sled_decoding` computes it): over the `evolution_scale` most likely tokens t of the final
layer and every candidate layer n, the cosine between (p_n - e_t) and (logits_n - logits_final);
its positive part squared, normalised over the tokens of a layer, weights the tokens, and each
layer weighs by its share of the total. Their sum is the latent distribution m; the final logits
take one step against the gradient of KL(m || softmax(logits)): logits - evolution_rate * (p_final
- m) on those top tokens; every other token gets `evolution_lower_bound`.

Early-layer logits are the final norm and the LM head applied to the layer's hidden state (layer
0 = the embedding output). `ModelRunner` computes them only for the rows of requests that ask.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.decoding.premature_layers import request_layers

# DoLa's adaptive plausibility constraint: keep tokens with p_final >= ALPHA * max p_final.
PLAUSIBILITY_ALPHA = 0.1
# torch.nn.functional.cosine_similarity's eps: the product of the norms is clamped to it.
COSINE_EPS = 1e-8


@dataclass
class ExitPlan:
    """The sampled rows of one step whose requests contrast layers, and what they need."""

    rows: list[int]  # positions among the step's sampled rows
    layers: list[int]  # the union of their premature layers, ascending
    member: torch.Tensor  # [len(rows), len(layers)] bool: the layer is one of the row's candidates
    params: list[SamplingParams]  # of each row in `rows`


def plan_exits(
    params: list[SamplingParams], num_layers: int, tied_embeddings: bool
) -> ExitPlan | None:
    """None when no sampled row asks for DoLa or SLED (the forward pass then keeps nothing)."""
    wanted = [
        (i, p, layers)
        for i, p in enumerate(params)
        if (layers := request_layers(p, num_layers, tied_embeddings)) is not None
    ]
    if not wanted:
        return None
    union = sorted({layer for _, _, layers in wanted for layer in layers})
    column = {layer: j for j, layer in enumerate(union)}
    member = torch.zeros(len(wanted), len(union), dtype=torch.bool)
    for r, (_, _, layers) in enumerate(wanted):
        member[r, [column[layer] for layer in layers]] = True
    return ExitPlan([i for i, _, _ in wanted], union, member, [p for _, p, _ in wanted])


def contrast_layers(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    final_hidden: torch.Tensor,  # [N, hidden] of every sampled row
    early_hidden: torch.Tensor,  # [R, U, hidden]: the plan's rows after each of its layers
    plan: ExitPlan,
) -> torch.Tensor:  # [N, vocab] float32: the model's logits, the plan's rows replaced
    """Logits of every sampled row, with one LM-head pass over final and early states."""
    num_rows, num_layers, width = early_hidden.shape
    n = final_hidden.shape[0]
    logits = compute_logits(torch.cat([final_hidden, early_hidden.reshape(-1, width)]))
    final, early = logits[:n], logits[n:].view(num_rows, num_layers, -1)
    member = plan.member.to(final.device)
    rows = torch.tensor(plan.rows, dtype=torch.int64, device=final.device)
    out = final.clone()
    dola = [r for r, p in enumerate(plan.params) if p.dola_layers is not None]
    sled = [r for r, p in enumerate(plan.params) if p.dola_layers is None]
    if dola:
        pick = torch.tensor(dola, device=final.device)
        out[rows[pick]] = dola_logits(final[rows[pick]], early[pick], member[pick])
    if sled:
        pick = torch.tensor(sled, device=final.device)
        chosen = [plan.params[r] for r in sled]
        out[rows[pick]] = sled_logits(
            final[rows[pick]],
            early[pick],
            member[pick],
            evolution_rate=[p.evolution_rate for p in chosen],
            evolution_scale=[p.evolution_scale for p in chosen],
            evolution_lower_bound=[p.evolution_lower_bound for p in chosen],
        )
    return out


def dola_logits(
    final: torch.Tensor,  # [R, V] final-layer logits
    early: torch.Tensor,  # [R, U, V] logits of layers U
    member: torch.Tensor,  # [R, U] bool: which of U are each row's candidate layers
) -> torch.Tensor:  # [R, V]
    log_final = F.log_softmax(final.float(), dim=-1)
    log_early = F.log_softmax(early.float(), dim=-1)
    mean = 0.5 * (log_final.exp()[:, None, :] + log_early.exp())
    # F.kl_div(input, target) = KL(target || exp(input)), per element; averaged over the vocab.
    kl_final = F.kl_div(log_final[:, None, :].expand_as(mean), mean, reduction="none").mean(-1)
    kl_early = F.kl_div(log_early, mean, reduction="none").mean(-1)
    divergence = (0.5 * (kl_final + kl_early)).masked_fill(~member, float("-inf"))
    premature = divergence.argmax(dim=-1)  # [R]: the first of equal maxima
    log_premature = log_early[torch.arange(len(premature), device=final.device), premature]
    threshold = log_final.max(dim=-1, keepdim=True).values + math.log(PLAUSIBILITY_ALPHA)
    return (log_final - log_premature).masked_fill(log_final < threshold, float("-inf"))


def sled_logits(
    final: torch.Tensor,  # [R, V]
    early: torch.Tensor,  # [R, U, V]
    member: torch.Tensor,  # [R, U] bool
    evolution_rate: list[float],
    evolution_scale: list[int],
    evolution_lower_bound: list[float],
) -> torch.Tensor:  # [R, V]
    final, early = final.float(), early.float()
    num_rows, vocab = final.shape
    dev = final.device
    scale = torch.tensor(evolution_scale, device=dev).clamp(max=vocab)
    probs = torch.softmax(final, dim=-1)
    top_probs, top = probs.topk(int(scale.max()), dim=-1)  # [R, K]
    k = top.shape[1]
    in_scale = torch.arange(k, device=dev)[None, :] < scale[:, None]  # [R, K]
    early_probs = torch.softmax(early, dim=-1)
    direction = early - final[:, None, :]  # [R, U, V]
    at_top = top[:, None, :].expand(-1, early.shape[1], -1)  # [R, U, K]
    # cos(p_n - e_t, direction) for every top token t without building [R, U, K, V]:
    # (p_n - e_t) . d = p_n . d - d_t and |p_n - e_t|^2 = |p_n|^2 - 2 p_n[t] + 1.
    dot = (early_probs * direction).sum(-1, keepdim=True) - direction.gather(2, at_top)
    grad_sq = early_probs.square().sum(-1, keepdim=True) - 2 * early_probs.gather(2, at_top) + 1
    dir_sq = direction.square().sum(-1, keepdim=True)
    cosine = dot / torch.sqrt((grad_sq * dir_sq).clamp_min(COSINE_EPS**2))
    weight = cosine.clamp_min(0).square() * (member[:, :, None] & in_scale[:, None, :])
    layer_weight = weight.sum(-1, keepdim=True)  # [R, U, 1]
    weight = torch.where(layer_weight > 0, weight / layer_weight, weight)
    total = layer_weight.sum(1, keepdim=True)  # [R, 1, 1]
    layer_weight = torch.where(total > 0, layer_weight / total, layer_weight)
    latent = (weight * layer_weight).sum(1)  # [R, K]
    rate = torch.tensor(evolution_rate, device=dev)[:, None]
    evolved = final.gather(1, top) - rate * (top_probs - latent)
    floor = torch.tensor(evolution_lower_bound, device=dev)[:, None]
    out = floor.expand(num_rows, vocab).clone()
    return out.scatter_(1, top, torch.where(in_scale, evolved, floor))
