"""FP8 calls: float8_e4m3fn q, k and v with per (batch, key/value head) descale factors, forward only."""

import torch

from .arguments import _sizes


class Fp8:
    """FP8 calls of an Attention (a mixin)."""

    def _fp8_attention(self, q, k, v, inputs, descales, tile_tables):
        """An FP8 call: float8_e4m3fn q, k and v, each of which times its descale factor (q_descale, k_descale,
        v_descale: (B, HKV) float32, one per batch row and key/value head as FlashAttention-3 takes them;
        None for 1) is the attention's q, k or v. Returns (out, lse), out bfloat16. The first family of
        FP8_FAMILIES that admits the call runs it (the Hopper family's Gluon forward), else the portable
        forward: products of e4m3 operands, P rounded to e4m3 for its product with V, as FlashAttention-3's
        FP8 forward does. There is no backward (no public kernel has an FP8 backward: train in bf16)."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *inputs.values())):
            self._fail("an FP8 call (float8_e4m3fn q, k and v) has no backward pass: call it under torch.no_grad(), "
                       "or with tensors that do not require grad")
        if torch.compiler.is_compiling():
            self._fail("an FP8 call (float8_e4m3fn q, k and v) runs eagerly only, not under torch.compile")
        B, H, HKV, Q_LEN, KV_LEN, _, _ = self._check(q, k, v, inputs, fp8=True)
        if q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 9):
            self._fail(f"an FP8 call needs a GPU with e4m3 tensor cores (compute capability 8.9 or more: Ada, Hopper), "
                       f"got {torch.cuda.get_device_name(q.device)}")
        scales = []
        for name, t in zip(("q_descale", "k_descale", "v_descale"), descales):
            if t is None:
                t = torch.ones((B, HKV), dtype=torch.float32, device=q.device)
            elif not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and tuple(t.shape) == (B, HKV)
                      and t.device == q.device):
                self._fail(f"{name} must be a float32 tensor of shape (B, HKV) = ({B}, {HKV}) on {q.device}, got "
                           + (f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor)
                              else type(t).__name__))
            scales.append(t)
        # One pair of strides serves the three factors: each dense in (B, HKV).
        scales = [t.contiguous() for t in scales]
        tensors = [inputs[name].contiguous() for name in self.facts.inputs]
        known = {} if tile_tables is None else self._checked_tables(tile_tables, q, v, (B, H, HKV, Q_LEN, KV_LEN))
        return self._forward_with_tables(q, k, v, tensors, known, self._builder(_sizes(q, k), q.device, tensors),
                                         sink=self._sink_rows(q, k, inputs), fp8=scales)
