"""What each rank runs in the TP tests (module-level so spawn can import it)."""

from __future__ import annotations

from pathlib import Path

import torch

from mint_server.model import kernels
from mint_server.model import tp as tpmod
from mint_server.model.kv_cache import CacheView, KVCache
from mint_server.model.loader import load_model
from mint_server.model.lora import LoraBank, LoraBatch, init_lora_weights, select_targets, target_experts


def random_adapters(cfg, n: int, rank: int) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """n full adapters on every target, B non-zero so every LoRA path changes the output."""
    from mint_server.model.lora import target_shapes

    shapes, experts = target_shapes(cfg), target_experts(cfg)
    out = []
    for i in range(n):
        w = init_lora_weights(shapes, select_targets(), rank, seed=100 + i, dtype=torch.float32, experts=experts)
        g = torch.Generator().manual_seed(200 + i)
        out.append({t: (a, torch.randn(b.shape, generator=g) * 0.05) for t, (a, b) in w.items()})
    return out


def _leaves(adapters, share):
    """Stacked [n, layers, ...] A/B leaves over the adapters (optionally this rank's share)."""
    weights, leaves = {}, {}
    for t in adapters[0]:
        As = [share(t, "A", a[t][0]).requires_grad_(True) for a in adapters]
        Bs = [share(t, "B", a[t][1]).requires_grad_(True) for a in adapters]
        leaves[t] = (As, Bs)
        weights[t] = (torch.stack(As), torch.stack(Bs))
    return weights, leaves


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[..., None])[..., 0]
    w = torch.linspace(-1.0, 2.0, targets.shape[1])
    return -(lp * w).sum()


def _run(model, cfg, adapters, tokens, rows, rank, share, bank_shapes, tp_world):
    """Logits, loss, LoRA gradients (per adapter/target, full shapes) and greedy tokens of one model."""
    alpha = 16.0
    scale = torch.tensor([alpha / rank] * len(adapters))
    out = {}
    # training: gradients through every LoRA path
    weights, leaves = _leaves(adapters, share)
    lora = LoraBatch(weights=weights, rows=torch.tensor(rows), scale=scale)
    targets = torch.roll(tokens, -1, dims=1)
    logits = model(tokens, lora=lora)
    loss = _loss(logits, targets)
    loss.backward()
    out["logits"] = logits.detach()
    out["loss"] = float(loss.detach())
    out["grads"] = {t: ([a.grad for a in As], [b.grad for b in Bs]) for t, (As, Bs) in leaves.items()}
    # sampling: the bank, a KV cache, greedy decoding of a mixed batch
    bank = LoraBank(cfg, len(adapters), 8, "cpu", torch.float32, shapes=bank_shapes)
    for s, a in enumerate(adapters):
        bank.write(s, {t: (share(t, "A", x), share(t, "B", y)) for t, (x, y) in a.items()}, rank, alpha)
    cache = KVCache(tpmod.local_config(cfg, tp_world), 16, 8, "cpu", torch.float32)
    B, T = tokens.shape
    table = torch.arange(1, 1 + B * 3).view(B, 3)
    with torch.no_grad():
        positions = torch.arange(T).expand(B, T)
        batch = bank.batch(rows)
        step_logits = model(tokens, positions, batch, CacheView(cache, table, positions))[:, -1]
        greedy, decode_logits = [], []
        for i in range(6):
            nxt = step_logits.argmax(-1)
            greedy.append(nxt)
            decode_logits.append(step_logits)
            pos = torch.full((B, 1), T + i)
            step_logits = model(nxt[:, None], pos, batch, CacheView(cache, table, pos))[:, 0]
    out["greedy"] = torch.stack(greedy, 1)
    out["decode_logits"] = torch.stack(decode_logits, 1)
    return out


def parity(tp: tpmod.TP, ckpt: str, modes: tuple[str, ...]) -> dict:
    """TP=1 (full model on this rank) vs this rank's TP share: max differences, per kernel mode."""
    torch.manual_seed(0)
    ref = load_model(Path(ckpt), "cpu", torch.float32)
    model = tpmod.shard_model(load_model(Path(ckpt), "cpu", torch.float32), tp)
    cfg = ref.config
    rank = 4
    adapters = random_adapters(cfg, 2, rank)
    tokens = torch.randint(0, cfg.vocab_size, (4, 10), generator=torch.Generator().manual_seed(1))
    rows = [0, 1, -1, 0]
    results = {}
    for mode in modes:
        with kernels.use(mode):
            want = _run(ref, cfg, adapters, tokens, rows, rank, lambda t, f, x: x.clone(), None, 1)
            got = _run(model, cfg, adapters, tokens, rows, rank,
                       lambda t, f, x: tpmod.shard_tensor(x, t, f, tp),
                       tpmod.local_target_shapes(cfg, tp.world), tp.world)
        grad_diff = 0.0
        grad_scale = 0.0
        for t, (As, Bs) in got["grads"].items():
            for factor, gs, ws in (("A", As, want["grads"][t][0]), ("B", Bs, want["grads"][t][1])):
                for g, w in zip(gs, ws, strict=True):
                    full = tpmod.gather_tensor(g, t, factor, tp)
                    grad_diff = max(grad_diff, float((full - w).abs().max()))
                    grad_scale = max(grad_scale, float(w.abs().max()))
        results[mode] = {
            "logits": float((got["logits"] - want["logits"]).abs().max()),
            "loss": abs(got["loss"] - want["loss"]),
            "loss_value": want["loss"],
            "grads": grad_diff,
            "grad_scale": grad_scale,
            "decode_logits": float((got["decode_logits"] - want["decode_logits"]).abs().max()),
            "greedy_equal": bool(torch.equal(got["greedy"], want["greedy"])),
            "lora_effect": float((want["logits"][0] - ref(tokens[:1])[0]).abs().max()),
        }
    results["vocab_parallel_logprobs"] = _vocab_parallel(tp, ref, model, tokens)
    # reading only this rank's slices from the checkpoint gives the same share as slicing the full model
    sliced = load_model(Path(ckpt), "cpu", torch.float32, tp=tp).state_dict()
    full = model.state_dict()
    results["sliced_load_equal"] = sorted(sliced) == sorted(full) and all(
        torch.equal(sliced[k], full[k]) for k in full)
    return results


def _vocab_parallel(tp: tpmod.TP, ref, model, tokens: torch.Tensor) -> dict[str, float]:
    """tp.target_logprobs on vocabulary slices vs losses.TargetLogprobs on the full logits: values and
    the gradient reaching the hidden states."""
    from mint_server.engine.losses import TargetLogprobs

    targets = torch.randint(0, ref.config.vocab_size, (*tokens.shape, 2), generator=torch.Generator().manual_seed(3))
    weights = torch.randn(targets.shape, generator=torch.Generator().manual_seed(4))
    h = ref.hidden_states(tokens).detach()
    h_ref, h_tp = h.clone().requires_grad_(True), h.clone().requires_grad_(True)
    want = TargetLogprobs.apply(ref.logits(h_ref), targets)
    got = tp.target_logprobs(model.local_logits(h_tp), targets, model.vocab_start)
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    return {"values": float((got - want).abs().max()), "grad": float((h_tp.grad - h_ref.grad).abs().max())}


def parity_all(tp: tpmod.TP, ckpts: dict[str, str], modes: tuple[str, ...], fused: str) -> dict:
    out = {family: parity(tp, ckpt, modes) for family, ckpt in ckpts.items()}
    # transformers' fused expert layout (gate_up_proj): sliced on read too
    sliced = load_model(Path(fused), "cpu", torch.float32, tp=tp).state_dict()
    full = tpmod.shard_model(load_model(Path(fused), "cpu", torch.float32), tp).state_dict()
    out["fused_sliced_load_equal"] = all(torch.equal(sliced[k], full[k]) for k in full)
    return out


def parity_mla(tp: tpmod.TP, ckpts: dict[str, str]) -> dict:
    return {family: parity(tp, ckpt, ("fast",)) for family, ckpt in ckpts.items()}
