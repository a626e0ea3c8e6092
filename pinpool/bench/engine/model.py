"""A tiny decoder with random weights whose attention reads its KV cache through
``req_to_token`` rows and KV slot indices, so the cache metadata is really consumed.

Not a real model: 2 layers, learned absolute positions, fixed seed. It exists to give
the reference decode loop genuine GPU work that depends on every staged value.
"""

from __future__ import annotations

import math

import attrs
import torch


@attrs.frozen
class ModelConfig:
    vocab_size: int = 32_000
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    ffn: int = 512
    max_context_len: int = 512
    seed: int = 0
    #: Weights, activations and the KV cache; logits are float32 whatever it is.
    dtype: str = "float32"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"'dtype' must name a torch floating dtype, e.g. 'bfloat16' (got {self.dtype!r})")
        return dtype


class KVCache:
    """K and V per layer for ``num_slots`` KV slots (slot 0 is the allocator's padding slot)."""

    def __init__(self, cfg: ModelConfig, num_slots: int, device: torch.device) -> None:
        shape = (cfg.layers, num_slots + 1, cfg.heads, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=cfg.torch_dtype)
        self.v = torch.zeros(shape, device=device, dtype=cfg.torch_dtype)


class TinyDecoder:
    """forward(tokens, positions, token_rows, out_cache_loc, last_index) -> logits of the last tokens."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)

        # Weights stay [in, out] (x @ W). torch's Linear layout ([out, in], x @ W.T) was tried
        # and gave a slower replayed decode step on an H200 in both configs, by 18% and 23%
        # (same random values; the figures are in tests/bench/RESULTS.md's history).
        dtype = cfg.torch_dtype

        def weight(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) / math.sqrt(shape[0])).to(device, dtype)

        h = cfg.hidden
        self.embed = (torch.randn(cfg.vocab_size, h, generator=gen) * 0.5).to(device, dtype)
        self.pos_embed = (torch.randn(cfg.max_context_len, h, generator=gen) * 0.1).to(device, dtype)
        self.blocks = [
            {"qkv": weight(h, 3 * h), "o": weight(h, h), "up": weight(h, cfg.ffn), "down": weight(cfg.ffn, h)}
            for _ in range(cfg.layers)
        ]
        self.lm_head = weight(h, cfg.vocab_size) * 4.0  # sharper logits: sampling filters matter
        # For the attention mask, built once: every key position as a row, and the additive
        # mask's two values in the activation dtype (0 where a key is visible, -inf where not).
        self.key_positions = torch.arange(cfg.max_context_len, device=device)[None, :]
        self.visible_value = torch.zeros((), device=device, dtype=dtype)
        self.hidden_value = torch.full((), -math.inf, device=device, dtype=dtype)

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,  # int64 [T] input token ids
        positions: torch.Tensor,  # int64 [T] their positions
        token_rows: torch.Tensor,  # int64 [T] req_to_token row of each token's request
        out_cache_loc: torch.Tensor,  # int64 [T] KV slot each token's K/V is written to
        last_index: torch.Tensor,  # int64 [bs] index into T of each request's last token
        req_to_token: torch.Tensor,  # int32 [rows, max_context_len]
        cache: KVCache,
        max_len: int,  # host int: longest sequence in the batch (bounds the gather)
    ) -> torch.Tensor:
        cfg = self.cfg
        if max_len > cfg.max_context_len:
            raise ValueError(f"'max_len' must be <= max_context_len={cfg.max_context_len} (got {max_len})")
        hidden = (cfg.hidden,)
        x = self.embed[tokens] + self.pos_embed[positions]
        # Every token attends to the KV slots of its request's row, positions 0..its own.
        # The slots are made int64 once here: indexing converts int32 indices itself, a
        # kernel per use (two per layer).
        slots = req_to_token[token_rows, :max_len].long()  # [T, max_len]
        # The additive mask scaled_dot_product_attention would build from a bool mask itself
        # (two fills and a where, per layer), made once per step: a compare and a where.
        visible = self.key_positions[:, :max_len] <= positions[:, None]
        mask = torch.where(visible, self.visible_value, self.hidden_value)[:, None, None, :]
        # Few, fused kernels per layer (rms_norm, addmm, one attention call): in a replayed
        # graph each kernel costs its launch latency on the GPU, and a step of a tiny model
        # is mostly that. The residual adds are in place (addmm_): out of place, addmm
        # first copies x into its result, one more node per product.
        for layer, w in enumerate(self.blocks):
            qkv = torch.nn.functional.rms_norm(x, hidden, eps=1e-6) @ w["qkv"]
            q, k, v = qkv.view(-1, 3, cfg.heads, cfg.head_dim).unbind(1)
            cache.k[layer, out_cache_loc] = k
            cache.v[layer, out_cache_loc] = v
            keys = cache.k[layer][slots].transpose(1, 2)  # [T, heads, max_len, hd]
            values = cache.v[layer][slots].transpose(1, 2)
            attn = torch.nn.functional.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=mask)
            x.addmm_(attn.reshape(-1, cfg.hidden), w["o"])
            up = torch.nn.functional.gelu(torch.nn.functional.rms_norm(x, hidden, eps=1e-6) @ w["up"])
            x.addmm_(up, w["down"])
        logits = torch.nn.functional.rms_norm(x[last_index], hidden, eps=1e-6) @ self.lm_head
        return logits if logits.dtype == torch.float32 else logits.float()


class SleepModel:
    """A stand-in for a model whose step is GPU-bound: one sleep kernel, then logits from a table.

    Used to time the loop's overhead against a known amount of GPU work (``pinpool bench``'s
    GPU-bound row); it still reads the staged tokens and positions.
    """

    def __init__(self, cfg: ModelConfig, device: torch.device, sleep_cycles: int) -> None:
        gen = torch.Generator().manual_seed(cfg.seed)
        self.table = (torch.randn(1024, cfg.vocab_size, generator=gen) * 4.0).to(device)
        self.sleep_cycles = sleep_cycles
        self.cuda = device.type == "cuda"

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        token_rows: torch.Tensor,
        out_cache_loc: torch.Tensor,
        last_index: torch.Tensor,
        req_to_token: torch.Tensor,
        cache: KVCache,
        max_len: int,
    ) -> torch.Tensor:
        if self.cuda and self.sleep_cycles:
            torch.cuda._sleep(self.sleep_cycles)
        key = (tokens[last_index] * 7 + positions[last_index]) % self.table.shape[0]
        return self.table[key]
