"""FlexAttention's test mods and attention-gym's masks and mods, spelled in .attn: each spelling's kernels
match the float64 reference forward and backward.

The spellings are written here from reading the originals: every score_mod and mask_mod of PyTorch's
test/inductor/test_flex_attention.py (module level, test bodies, parametrizations, lambdas; pytorch/pytorch
at commit 00125ef3 and a later, device-generic version of the file), and of attention-gym's attn_gym/masks
and attn_gym/mods (meta-pytorch/attention-gym, and the pytorch-labs copy's dilated_sliding_window.py,
flamingo.py and sink_attn.py). A mod that reads a captured tensor reads an input of the same shape; one
that builds a table outside the mod (Sandwich's cosine table, MLA's RoPE dot products, VSA's top-k tiles,
Graphormer's path tables) reads that table as an input, as the original's mod does. Masks written as
`where(cond, score, -inf)` score mods are spelled as masks. Sizes are scaled to the test grid (37
positions). A few cases run in the default tier; the rest are slow in the interpreter.

The same function under another name has no entry of its own:
- identity: `_identity`, `noop_mask`, `noop_mod`.
- causal: `_causal`, `_causal_mask` and every `q >= kv` mask_mod or lambda of the test bodies (the
  block-mask, GQA, paged, SDPA-comparison, pytree, CUDA-graph and device tests), `scoremod_2` of the
  multiple-call tests, dynamic_divisibility_guards' score_mod.
- inverse_causal: `_inverse_causal_mask`, `score_mod_2` of function_composition, and
  autograd_function_in_score_mod's `ApplyMask` (its backward passes the gradient where the mask is
  false too, where P is 0).
- rel_bias: `scoremod_1` of the multiple-call tests, non_pow_2_headdim's; alibi_bias: test_strided_inputs'
  mod (with causal in the dynamic-max-autotune test); times_two: max_autotune's, float32_matmul_precision's
  and flex_attention_logging's (with causal) mods; squared: fw_bw_graph_correctness's.
- captured_scale: recompile_changed_score_mod's `ADD` branch (the other branch has its entry);
  captured_buffers_all_dims: max_autotune_with_captured's; load_from_bias_head_seq_batch:
  modular_indexing's (a doubled bias viewed as [B, H, N, N]); test_buffer_reduced below:
  captured_reduction's; head_offset: captured_score_mod_aot_eager_gradcheck's.
- mask_mod_combiners: and_masks(causal, sliding_window); gym_sliding_window: lse_masked_output's
  `sliding_window_causal`; doc_mask_sparse: compiling_create_block_mask's `(q >= kv) & (seq[q] == seq[kv])`.
- block_mask_non_divisible: doc_mask_clamped_repro's first `doc_mask_mod` and attention-gym's
  generate_doc_mask_mod(noop_mask) (an id table compared at q and k).
- block_mask_offset_causal: the `(q + offset[b] * 128) >= kv` mask of block_mask_attributes, getitem,
  block_mask_device_change and block_mask_viz (float and int offsets).
- reduction_unrolled: captured_wrong_device_error_message's `euclidean_dist_pos_embed`; that of
  cant_lower_error_message is the same function over 256 coordinates (the same sum with 256 terms).
- rel_pos_2d: rel_pos_2d's `bias[q][kv]` form and TestLearnableBiases' absolute_2d_bias;
  rel_pos_2d_transposed: flipped_indexed_bias; relative_1d_bias: relative_1d_bias_only_grad;
  batch_head_bias: learnable_bias_global_compiled's.
- gym_alibi: generate_alibi_bias (with its demo's causal mask; without it, alibi_bias with num_heads = H);
  gym_tanh_softcap: generate_tanh_softcap(approx=True) (`tanh.approx.f32` approximates the same tanh);
  the natten_morton tests below: generate_morton_natten.

Spelled only for a fixed size, since the language reduces inputs (`sum(x[b, :])`) but not expressions of
q and k: VSA's top-k membership (`.any(dim=-1)` over the top-k dim, unrolled for a top-k of 2), MLA's
RoPE `torch.dot` (unrolled over a RoPE dim of 4) and the Euclidean distance's `.sum(-1)` (3 coordinates).
Not score or mask mods, so not spelled: attention-gym's `exclusive_output_mod` (exclusive_sa.py) and
`undo_softmax` (activation.py) post-process the attention output with V and the LSE outside the kernel.
"""

import contextlib
from pathlib import Path

import pytest
import torch

import attngen
from attngen import testing
from attngen.errors import SpecWarning
from attngen.reference import evaluate_expr, make_env
from conftest import SLOW_IN_INTERPRETER

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on a GPU only: the interpreter's bf16 dot is wrong (tests/test_kernels.py says more).
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
SPECS = Path(__file__).resolve().parent.parent / "specs"
B, H, HKV, N, D = 2, 2, 1, 37, 16


# name -> (spec body, inputs that random_inputs would not give: name -> tensor).
FLEX_TESTS = {
    "times_two": ("score: score * 2", {}),
    "squared": ("score: score * score", {}),
    "causal": ("mask: q >= k", {}),
    "inverse_causal": ("mask: q <= k", {}),
    "rel_bias": ("score: score + (q - k)", {}),
    "rel_causal": ("mask: q >= k\nscore: score + (q - k)", {}),
    "alibi_bias": ("param num_heads = 8\nscore: score + (k - q) * exp2(-((h + 1) * 8.0 / num_heads))", {}),
    "head_offset": ("input head_offset: f32[H]\nscore: score * head_offset[h]", {}),
    "trig": ("score: sin(cos(score)) + tan(b)", {}),
    "trig2": ("score: cos(score) * sin(score) + tan(b)", {}),
    "doc_mask_sparse": ("input document_id: i32[KV_LEN]\nmask: (q >= k) & (document_id[q] == document_id[k])", {}),
    "index_multiple": ("input bias: f32[B, Q_LEN]\nscore: score + bias[b, q]", {}),
    "index_weird1": ("input bias: f32[4, B, H, Q_LEN]\nscore: score + bias[0, b, h, q]", {}),
    "index_weird2": ("input bias: f32[B, H, 4, Q_LEN]\ninput which_bias: i32[]\nscore: score + bias[b, h, which_bias, q]",
                     {"which_bias": torch.tensor(2, dtype=torch.int32)}),
    "skip_odd_keys": ("mask: k % 2 == 0", {}),
    "function_composition": ("mask: q <= k\nscore: score + (q - k)", {}),
    "captured_buffers_all_dims": ("input head_scale: f32[H]\ninput batch_scale: f32[B]\ninput tok_scale: f32[Q_LEN]\n"
                                  "score: score + tok_scale[q] + batch_scale[b] + head_scale[h]", {}),
    "seq_masking": ("input seq_idx: bool[KV_LEN]\nmask: seq_idx[q] == seq_idx[k]", {}),
    "load_from_bias_seq_only": ("input bias: f16[Q_LEN, KV_LEN]\nscore: score + bias[q, k]", {}),
    "load_from_bias_seq_batch": ("input bias: f16[B, Q_LEN, KV_LEN]\nscore: score + bias[b, q, k]", {}),
    "load_from_bias_head_seq_batch": ("input bias: f16[B, H, Q_LEN, KV_LEN]\nscore: score + bias[b, h, q, k]", {}),
    "load_rel_bias": ("input rel_bias: f32[*]\nscore: score + rel_bias[(q - k) + KV_LEN]", {}),
    "dependent_causal_bidirectional": ("input num_bidirectional: i32[B]\n"
                                       "mask: (q <= num_bidirectional[b]) & (k <= num_bidirectional[b]) | (q >= k)", {}),
    "natten_2d": ("param W = 8\nparam WINDOW = 3\n"
                  "mask: (abs(q / W - k / W) <= WINDOW) | (abs(q % W - k % W) <= WINDOW)", {}),
    "subgraph_decomposition": ("score: score - q // (1 + k)", {}),
    "silu_on_score": ("score: score * sigmoid(score)", {}),
    "padded_dense_causal": ("input seq_len: i32[B]\nscore: where(score <= seq_len[b] and q >= k, score, -inf)", {}),
    "captured_scale": ("input offset: i32[]\nscore: score + offset", {}),
    "inputs_are_realized": ("input x: f32[*]\nscore: score + x[q]", {}),
    "njt_causal": ("input offsets: i32[4]\ninput seq_idx: i32[KV_LEN]\n"
                   "mask: q - offsets[seq_idx[q]] >= k - offsets[seq_idx[k]]",
                   {"offsets": torch.tensor([0, 9, 20, 37], dtype=torch.int32)}),
    "new_empty_mask_mod": ("input attn_mask: bool[B, 1, Q_LEN, KV_LEN]\nmask: attn_mask[b, 0, q, k]\n"
                           "score: score + where(attn_mask[b, 0, q, k], 1.0, 0.0)", {}),
    "load_from_view_buffer": ("param W = 8\ninput rel_h: f32[B, H, Q_LEN, *]\nscore: score + rel_h[b, h, q, k // W]", {}),
    "mask_mod_combiners": ("param window = 12\nmask: (q >= k) & ((q - k) <= window)", {}),
    "multiple_mask_calls": ("param window_size = 5\nmask: (q >= k) & (q <= k + window_size)", {}),
    "identity": ("", {}),
    "recompile_changed_score_mod": ("input factor: i32[]\nscore: score * factor", {"factor": torch.tensor(2, dtype=torch.int32)}),
    "neg_causal": ("mask: q < k", {}),
    "sliding_window_only": ("param window = 12\nmask: (q - k) <= window", {}),
    "and_masks_empty": ("mask: (q >= k) & (q < k)", {}),
    "or_masks_full": ("mask: (q >= k) | (q < k)", {}),
    "block_mask_reuse_weird": ("param lo = 3\nparam hi = 19\nmask: (k < lo) | (k >= hi)", {}),
    "document_masking_edge_case": ("input document_masks: i32[B, KV_LEN]\n"
                                   "mask: document_masks[b, q] == document_masks[b, k]", {}),
    "fully_masked_out_rows": ("param M = 18\nmask: q < M", {}),
    "block_mask_non_divisible": ("input seq: i64[KV_LEN]\nmask: seq[q] == seq[k]", {"seq": torch.arange(N) // 8}),
    "head_bias_req_grad": ("input bias: f16[H] learnable\nscore: score + bias[h]", {}),
    "rel_pos_1d": ("input bias: f16[*] learnable\nscore: score + bias[q + k]", {}),
    "rel_pos_2d": ("input bias: f16[Q_LEN, KV_LEN] learnable\nscore: score + bias[q, k]", {}),
    "rel_pos_2d_transposed": ("input bias: f16[KV_LEN, Q_LEN] learnable\nscore: score + bias[k, q]", {}),
    "rel_pos_3d_transposed": ("input bias: f16[H, KV_LEN, Q_LEN] learnable\nscore: score + bias[h, k, q]", {}),
    "lse_masked_output_global_causal": ("param window = 8\nmask: (q >= k) & (q - k > window)", {}),
    "reduction_unrolled": ("input means: f32[KV_LEN, 3]\ninput length_scales: f32[H]\n"
                           "score: score * exp(-sqrt((means[q, 0] - means[k, 0]) ** 2 + (means[q, 1] - means[k, 1]) ** 2\n"
                           "                        + (means[q, 2] - means[k, 2]) ** 2) / length_scales[h])",
                           {"length_scales": torch.logspace(0.001, 0.1, H)}),
    "dynamic_batch_padding": ("input input_lengths: i32[B]\nmask: (q < input_lengths[b]) & (k < input_lengths[b])", {}),
    "non_divisible_offsets": ("input offset_q: bf16[Q_LEN]\ninput offset_kv: bf16[KV_LEN]\nmask: q >= k\n"
                              "score: score + offset_q[q] + offset_kv[k]", {}),
    "non_divisible_multiplier": ("input multiplier: bf16[Q_LEN]\nscore: score * multiplier[q]", {}),
    "batch_flip_causal": ("mask: (q >= k) & (b % 2 == 0)", {}),
    "free_symbol_rand_mask": ("input rand_mask: bool[B, Q_LEN]\nmask: ~rand_mask[b, q]", {}),
    "symbol_closure": ("score: score + B", {}),
    "block_mask_offset_causal": ("param block = 8\ninput offset: f32[8]\nmask: q + offset[b] * block >= k",
                                 {"offset": torch.arange(8, dtype=torch.float32)}),
    "doc_mask_clamped": ("input doc_ids: i32[KV_LEN]\n"
                         "mask: doc_ids[clamp(q, 0, KV_LEN - 1)] == doc_ids[clamp(k, 0, KV_LEN - 1)]", {}),
    "relative_1d_bias": ("input bias: f32[*] learnable\nscore: score + bias[abs(q - k)]", {}),
    "head_specific_bias": ("input bias: f32[H, Q_LEN, KV_LEN] learnable\nscore: score + bias[h, q, k]", {}),
    "batch_head_bias": ("input bias: f32[B, H, Q_LEN, KV_LEN] learnable\nscore: score + bias[b, h, q, k]", {}),
    "multiplicative_bias": ("input bias: f32[Q_LEN] learnable\nscore: score * bias[q]", {}),
    "local_window_bias": ("param window_size = 8\ninput bias: f32[17] learnable\n"
                          "score: score + bias[clamp(q - k + window_size, 0, 2 * window_size)]", {}),
    "global_tokens_bias": ("input bias: f32[KV_LEN] learnable\nscore: score + bias[k]", {}),
    "weird_bias": ("input bias: f32[B, H, 4, Q_LEN] learnable\ninput which_bias: i64[]\n"
                   "score: score + bias[b, h, which_bias, q]", {"which_bias": torch.tensor(0)}),
    "indirect_bias": ("input bias: f32[Q_LEN] learnable\ninput offset: i64[Q_LEN]\nscore: score + bias[offset[q]]",
                      {"offset": torch.randint(0, N, (N,), generator=torch.Generator().manual_seed(0))}),
    "symmetric_bias": ("input bias: f32[KV_LEN] learnable\nscore: score + bias[q] + bias[k]", {}),
    "head_specific_gate": ("input gate_score: f32[H] learnable\nscore: score * sigmoid(gate_score[h])", {}),
    "distinct_biases": ("input bias1: f32[Q_LEN] learnable\ninput bias2: f32[KV_LEN] learnable\n"
                        "score: score + bias1[q] + bias2[k]", {}),
    "small_block_mask": ("input q_batch: i64[Q_LEN]\ninput kv_batch: i64[KV_LEN]\n"
                         "mask: (q_batch[q] == kv_batch[k]) & (q_batch[q] != -1) & (kv_batch[k] != -1)",
                         {"q_batch": torch.tensor([0] * 9 + [1] * 12 + [2] * 11 + [-1] * 5),
                          "kv_batch": torch.tensor([0] * 9 + [1] * 12 + [2] * 11 + [-1] * 5)}),
    "dynamic_captured_buffer": ("input head_scale: f16[H] learnable\nscore: score * head_scale[h]", {}),
    "symint_addition": ("param frame = 32\nmask: q < (Q_LEN // frame + KV_LEN // frame) * frame", {}),
    "upcast_appropriately": ("input mass: f16[1]\nscore: score + log(mass[0])",
                             {"mass": torch.tensor([1.5], dtype=torch.float16)}),
    # rows b >= B of the table are NaN and never read
    "poisoned_rel_logits": ("input rel_logits: f32[*, H, Q_LEN, KV_LEN]\nmask: q >= k\nscore: score + rel_logits[b, h, q, k]",
                            {"rel_logits": torch.cat([torch.randn(B, H, N, N, generator=torch.Generator().manual_seed(0)),
                                                      torch.full((B, H, N, N), float("nan"))])}),
    "poison_mod_fwd": ("mask: q >= k\nscore: 1 / score", {}),
    "poison_mod_bwd": ("mask: q >= k\nscore: where(score > 0, log(score), score)", {}),
    # the original's offset is an int64 tensor; arithmetic on an i64 input is refused (it could overflow)
    "broadcasted_head_offset": ("input offset: i32[]\nmask: q + offset >= k", {"offset": torch.tensor(5, dtype=torch.int32)}),
    # its bias_mat = y[b, q] + y[b, kv] is built outside the mod; spelled from y, which the gradient reaches there too
    "backprop_error_case": ("input y: f32[B, KV_LEN] learnable\nscore: score + y[b, q] + y[b, k]", {}),
    "inspect_bug": ("input val: f32[]\nmask: abs(q - k) < val", {"val": torch.tensor(5.5)}),
    # FlexAttentionCPB of custom_score_mod_layout_freeze: a gated bias from a table of an MLP's outputs,
    # indexed by a relative-position table, past the first r_cutoff tokens
    "custom_score_mod_cpb": ("input r_cutoff: i64[]\ninput idx_table: i64[Q_LEN, KV_LEN]\ninput bt: f32[121, H]\n"
                             "input gam_sig: f32[H]\ninput mu: f32[B, H, 2, Q_LEN]\n"
                             "score: score + (where(q >= r_cutoff and k >= r_cutoff, 1.0, 0.0) * gam_sig[h]\n"
                             "                * (mu[b, h, 0, q] + mu[b, h, 1, k]) * bt[idx_table[q, k], h])",
                             {"r_cutoff": torch.tensor(1),
                              "idx_table": torch.randint(0, 121, (N, N), generator=torch.Generator().manual_seed(0)),
                              "gam_sig": torch.sigmoid(torch.randn(H, generator=torch.Generator().manual_seed(1)))}),
}

GYM = {
    "gym_causal": ("mask: q >= k", {}),
    "gym_sliding_window": ("param window_size = 5\nmask: q - k <= window_size and q >= k", {}),
    "gym_prefix_lm": ("param prefix_length = 9\nmask: k < prefix_length or q >= k", {}),
    "gym_document_causal": ("input offsets: i32[5]\ninput document_id: i32[KV_LEN]\n"
                            "mask: (document_id[q] == document_id[k]\n"
                            "       and q - offsets[document_id[q]] >= k - offsets[document_id[k]])",
                            {"offsets": torch.tensor([0, 5, 17, 30, 37], dtype=torch.int32),
                             "document_id": torch.tensor([0] * 5 + [1] * 12 + [2] * 13 + [3] * 7, dtype=torch.int32)}),
    "gym_packed_causal_doc": ("input offsets: i32[5]\ninput document_id: i32[KV_LEN]\n"
                              "mask: k >= offsets[document_id[q]] and q >= k",
                              {"offsets": torch.tensor([0, 5, 17, 30, 37], dtype=torch.int32),
                               "document_id": torch.tensor([0] * 5 + [1] * 12 + [2] * 13 + [3] * 7, dtype=torch.int32)}),
    "gym_shared_prefix": ("input offsets: i32[5]\ninput document_id: i32[KV_LEN]\ninput prefix_document_id: i32[4]\n"
                          "mask: ((k >= offsets[document_id[q]] and q >= k)\n"
                          "       or (document_id[q] != prefix_document_id[document_id[q]]\n"
                          "           and k >= offsets[prefix_document_id[document_id[q]]]\n"
                          "           and k < offsets[prefix_document_id[document_id[q]] + 1]))",
                          {"offsets": torch.tensor([0, 5, 17, 30, 37], dtype=torch.int32),
                           "document_id": torch.tensor([0] * 5 + [1] * 12 + [2] * 13 + [3] * 7, dtype=torch.int32),
                           "prefix_document_id": torch.tensor([0, 0, 2, 2], dtype=torch.int32)}),
    "gym_global_sliding_window": ("param window_size = 3\ninput is_global: bool[KV_LEN]\n"
                                  "mask: (abs(q - k) <= window_size) | is_global[q] | is_global[k]", {}),
    "gym_batchify_causal": ("param batchify_size = 8\n"
                            "mask: (q // batchify_size == k // batchify_size) & (q % batchify_size >= k % batchify_size)",
                            {}),
    "gym_block_diffusion": ("param seq_len = 18\nparam block_size = 4\n"
                            "mask: ((q % seq_len // block_size == k % seq_len // block_size) & ((q < seq_len) == (k < seq_len))\n"
                            "      | (q % seq_len // block_size > k % seq_len // block_size) & (q < seq_len) & ~(k < seq_len)\n"
                            "      | (q % seq_len // block_size >= k % seq_len // block_size) & ~(q < seq_len) & ~(k < seq_len))",
                            {}),
    "gym_natten": ("param canvas_w = 6\nparam canvas_h = 7\nparam kernel_w = 3\nparam kernel_h = 3\n"
                   "mask: (abs(clamp(q // canvas_w, kernel_w // 2, canvas_w - 1 - kernel_w // 2) - k // canvas_w)"
                   " <= kernel_w // 2\n"
                   "      and abs(clamp(q % canvas_w, kernel_h // 2, canvas_h - 1 - kernel_h // 2) - k % canvas_w)"
                   " <= kernel_h // 2)", {}),
    "gym_tiled_natten": ("param W = 8\nparam HT = 6\nparam K_W = 3\nparam K_H = 3\nparam T_W = 2\nparam T_H = 2\n"
                         "mask: (abs(clamp(q // (T_H * T_W) % (W // T_W) * T_W + q % (T_H * T_W) % T_W,"
                         " K_W // 2, W - 1 - K_W // 2)\n"
                         "          - (k // (T_H * T_W) % (W // T_W) * T_W + k % (T_H * T_W) % T_W)) <= K_W // 2\n"
                         "      and abs(clamp(q // (T_H * T_W) // (W // T_W) * T_H + q % (T_H * T_W) // T_W,"
                         " K_H // 2, HT - 1 - K_H // 2)\n"
                         "              - (k // (T_H * T_W) // (W // T_W) * T_H + k % (T_H * T_W) // T_W)) <= K_H // 2)",
                         {}),
    "gym_sta_2d": ("param canvas_h = 8\nparam canvas_w = 4\nparam kernel_tile_h = 3\nparam kernel_tile_w = 1\n"
                   "param tile_h = 2\nparam tile_w = 2\nparam text_seq_len = 3\n"
                   "mask: ((q < canvas_h * canvas_w and k < canvas_h * canvas_w\n"
                   "       and k // (tile_h * tile_w) // (canvas_w // tile_w) >= clamp(q // (tile_h * tile_w) // (canvas_w // tile_w),"
                   " kernel_tile_h // 2, canvas_h // tile_h - 1 - (kernel_tile_h // 2 + kernel_tile_h % 2 - 1)) - kernel_tile_h // 2\n"
                   "       and k // (tile_h * tile_w) // (canvas_w // tile_w) <= clamp(q // (tile_h * tile_w) // (canvas_w // tile_w),"
                   " kernel_tile_h // 2, canvas_h // tile_h - 1 - (kernel_tile_h // 2 + kernel_tile_h % 2 - 1))"
                   " + kernel_tile_h // 2 + kernel_tile_h % 2 - 1\n"
                   "       and k // (tile_h * tile_w) % (canvas_w // tile_w) >= clamp(q // (tile_h * tile_w) % (canvas_w // tile_w),"
                   " kernel_tile_w // 2, canvas_w // tile_w - 1 - (kernel_tile_w // 2 + kernel_tile_w % 2 - 1)) - kernel_tile_w // 2\n"
                   "       and k // (tile_h * tile_w) % (canvas_w // tile_w) <= clamp(q // (tile_h * tile_w) % (canvas_w // tile_w),"
                   " kernel_tile_w // 2, canvas_w // tile_w - 1 - (kernel_tile_w // 2 + kernel_tile_w % 2 - 1))"
                   " + kernel_tile_w // 2 + kernel_tile_w % 2 - 1)\n"
                   "      or (q < canvas_h * canvas_w and k >= canvas_h * canvas_w and k < canvas_h * canvas_w + text_seq_len)\n"
                   "      or (q >= canvas_h * canvas_w and k < canvas_h * canvas_w + text_seq_len))", {}),
    "gym_svg_spatial": ("param prompt_length = 3\nparam token_per_frame = 5\nparam width = 2\nparam round_width = 4\n"
                        "mask: (k < prompt_length + token_per_frame or q < prompt_length\n"
                        "       or abs(q - k) < floor(width * token_per_frame / round_width) * round_width)", {}),
    "gym_svg_temporal": ("param prompt_length = 3\nparam num_frames = 6\nparam token_per_frame = 5\nparam width = 2\n"
                         "mask: (k < prompt_length or q < prompt_length\n"
                         "      or abs((q - prompt_length) % token_per_frame - (k - prompt_length) % token_per_frame)"
                         " < width * token_per_frame // num_frames)", {}),
    "gym_jetspec_tree": ("param prefix_length = 6\ninput ancestor: bool[Q_LEN, *]\n"
                         "mask: k < prefix_length or (k >= prefix_length and k < prefix_length + Q_LEN\n"
                         "      and ancestor[q, clamp(k - prefix_length, 0, Q_LEN - 1)])", {}),
    "gym_jetspec_training": ("param prefix_length = 5\nparam block_size = 4\n"
                             "mask: k < prefix_length or (k >= prefix_length and q // block_size == (k - prefix_length) // block_size\n"
                             "      and (k - prefix_length) % block_size <= q % block_size)", {}),
    "gym_vsa_fine": ("param tile_numel = 8\ninput selected: bool[B, H, *, *]\n"
                     "mask: selected[b, h, q // tile_numel, k // tile_numel]", {}),
    "gym_alibi": ("mask: q >= k\nscore: score + (k - q) * exp2(-((h + 1) * 8.0 / H))", {}),
    "gym_tanh_softcap": ("param soft_cap = 2\nscore: soft_cap * tanh(score / soft_cap)", {}),
    "gym_sandwich": ("input rel_bias: f32[*]\ninput head_scale: f32[H]\nmask: q >= k\n"
                     "score: score + rel_bias[q - k + KV_LEN - 1] * head_scale[h]", {}),
    "gym_activation_gelu": ("param offset = 1.0\nscore: log(0.5 * score * (1.0 + erf(score * 0.7071067811865476)) + offset)",
                            {}),
    "gym_activation_relu": ("param offset = 1.0\nscore: log(max(score, 0.0) + offset)", {}),
    "gym_graphormer_spatial": ("input spatial_bias: f32[H, 4] learnable\ninput distances: i32[B, Q_LEN, KV_LEN]\n"
                               "score: score + spatial_bias[h, distances[b, q, k]]", {}),
    "gym_graphormer_edge": ("input edge_bias: f32[H, 3, 4] learnable\ninput path_types: i32[B, Q_LEN, KV_LEN, 3]\n"
                            "input path_lengths: i32[B, Q_LEN, KV_LEN]\n"
                            "score: score + ((where(path_lengths[b, q, k] > 0, edge_bias[h, 0, path_types[b, q, k, 0]], 0.0)\n"
                            "                + where(path_lengths[b, q, k] > 1, edge_bias[h, 1, path_types[b, q, k, 1]], 0.0)\n"
                            "                + where(path_lengths[b, q, k] > 2, edge_bias[h, 2, path_types[b, q, k, 2]], 0.0))\n"
                            "               / max(path_lengths[b, q, k], 1))", {}),
    "gym_mla_rope": ("param rope_scale = 0.5\ninput rope_dots: f32[B, H, Q_LEN, KV_LEN]\n"
                     "score: score + rope_scale * rope_dots[b, h, q, k]", {}),
    "gym_mla_rope_dot": ("param rope_scale = 0.5\ninput query_rope: f32[B, H, Q_LEN, 4]\ninput key_rope: f32[B, 1, KV_LEN, 4]\n"
                         "score: score + rope_scale * (query_rope[b, h, q, 0] * key_rope[b, h // H, k, 0]\n"
                         "                             + query_rope[b, h, q, 1] * key_rope[b, h // H, k, 1]\n"
                         "                             + query_rope[b, h, q, 2] * key_rope[b, h // H, k, 2]\n"
                         "                             + query_rope[b, h, q, 3] * key_rope[b, h // H, k, 3])", {}),
    "gym_sink_window": ("param window_size = 5\nparam sink_size = 4\n"
                        "mask: ((q - k <= window_size) | (k < sink_size)) & (q >= k)", {}),
    "gym_dilated_sliding_window": ("param window_size = 6\nparam dilation = 2\n"
                                   "mask: (abs(q - k) <= window_size) & (abs(q - k) % dilation == 0)", {}),
    "gym_vision_cross_attention": ("input image_boundaries: i64[KV_LEN]\ninput intervals: i32[10, 2]\n"
                                   "mask: (q >= intervals[image_boundaries[k], 0]) & (q < intervals[image_boundaries[k], 1])",
                                   {"image_boundaries": torch.arange(N) // 4,
                                    "intervals": torch.tensor([[max(0, 4 * i - 5), 4 * i + 3] for i in range(10)],
                                                              dtype=torch.int32)}),
    "gym_batchify": ("param batchify_size = 8\nmask: q // batchify_size == k // batchify_size", {}),
    "gym_svg_spatial_no_sink": ("param prompt_length = 3\nparam token_per_frame = 5\nparam width = 2\nparam round_width = 4\n"
                                "mask: (k < prompt_length or q < prompt_length\n"
                                "       or abs(q - k) < floor(width * token_per_frame / round_width) * round_width)", {}),
    # canvas 2 x 4 x 4 in tiles of 1 x 2 x 2 (2 x 2 x 2 tiles of 4 tokens), a kernel of 2 x 2 x 1 tiles, 3 text tokens
    "gym_sta_3d": ("param tile_numel = 4\nparam canvas_tile_t = 2\nparam canvas_tile_h = 2\nparam canvas_tile_w = 2\n"
                   "param kernel_tile_t = 2\nparam kernel_tile_h = 2\nparam kernel_tile_w = 1\n"
                   "param vision_seq_len = 32\nparam text_seq_len = 3\n"
                   "mask: ((q < vision_seq_len and k < vision_seq_len\n"
                   "        and k // tile_numel // (canvas_tile_h * canvas_tile_w) >= clamp(q // tile_numel // (canvas_tile_h * canvas_tile_w),"
                   " kernel_tile_t // 2, canvas_tile_t - 1 - (kernel_tile_t // 2 + kernel_tile_t % 2 - 1)) - kernel_tile_t // 2\n"
                   "        and k // tile_numel // (canvas_tile_h * canvas_tile_w) <= clamp(q // tile_numel // (canvas_tile_h * canvas_tile_w),"
                   " kernel_tile_t // 2, canvas_tile_t - 1 - (kernel_tile_t // 2 + kernel_tile_t % 2 - 1))"
                   " + kernel_tile_t // 2 + kernel_tile_t % 2 - 1\n"
                   "        and k // tile_numel % (canvas_tile_h * canvas_tile_w) // canvas_tile_w >= clamp(q // tile_numel"
                   " % (canvas_tile_h * canvas_tile_w) // canvas_tile_w, kernel_tile_h // 2,"
                   " canvas_tile_h - 1 - (kernel_tile_h // 2 + kernel_tile_h % 2 - 1)) - kernel_tile_h // 2\n"
                   "        and k // tile_numel % (canvas_tile_h * canvas_tile_w) // canvas_tile_w <= clamp(q // tile_numel"
                   " % (canvas_tile_h * canvas_tile_w) // canvas_tile_w, kernel_tile_h // 2,"
                   " canvas_tile_h - 1 - (kernel_tile_h // 2 + kernel_tile_h % 2 - 1)) + kernel_tile_h // 2 + kernel_tile_h % 2 - 1\n"
                   "        and k // tile_numel % canvas_tile_w >= clamp(q // tile_numel % canvas_tile_w, kernel_tile_w // 2,"
                   " canvas_tile_w - 1 - (kernel_tile_w // 2 + kernel_tile_w % 2 - 1)) - kernel_tile_w // 2\n"
                   "        and k // tile_numel % canvas_tile_w <= clamp(q // tile_numel % canvas_tile_w, kernel_tile_w // 2,"
                   " canvas_tile_w - 1 - (kernel_tile_w // 2 + kernel_tile_w % 2 - 1)) + kernel_tile_w // 2 + kernel_tile_w % 2 - 1)\n"
                   "       or (q < vision_seq_len and k >= vision_seq_len and k < vision_seq_len + text_seq_len)\n"
                   "       or (q >= vision_seq_len and k < vision_seq_len + text_seq_len))", {}),
    # VSA's top-k membership test unrolled over a top-k of 2; 37 keys make 5 tiles of 8, the last with 5 real tokens
    "gym_vsa_topk": ("param tile_numel = 8\ninput topk_indices: i32[B, H, 5, 2]\n"
                     "mask: ((topk_indices[b, h, q // tile_numel, 0] == k // tile_numel)\n"
                     "       | (topk_indices[b, h, q // tile_numel, 1] == k // tile_numel))",
                     {"topk_indices": torch.randint(0, 5, (B, H, 5, 2), generator=torch.Generator().manual_seed(0),
                                                    dtype=torch.int32)}),
    "gym_vsa_topk_padded": ("param tile_numel = 8\ninput topk_indices: i32[B, H, 5, 2]\ninput variable_block_sizes: i64[5]\n"
                            "mask: (((topk_indices[b, h, q // tile_numel, 0] == k // tile_numel)\n"
                            "        | (topk_indices[b, h, q // tile_numel, 1] == k // tile_numel))\n"
                            "       & (k % tile_numel < variable_block_sizes[k // tile_numel]))",
                            {"topk_indices": torch.randint(0, 5, (B, H, 5, 2), generator=torch.Generator().manual_seed(1),
                                                           dtype=torch.int32),
                             "variable_block_sizes": torch.tensor([8, 6, 8, 8, 5])}),
    "gym_vsa_block_map_padded": ("param tile_numel = 8\ninput block_map: bool[B, H, 5, 5]\ninput variable_block_sizes: i64[5]\n"
                                 "mask: block_map[b, h, q // tile_numel, k // tile_numel]"
                                 " & (k % tile_numel < variable_block_sizes[k // tile_numel])",
                                 {"variable_block_sizes": torch.tensor([8, 6, 8, 8, 5])}),
    "gym_vsa_padding": ("param tile_numel = 8\ninput variable_block_sizes: i64[5]\n"
                        "mask: k % tile_numel < variable_block_sizes[k // tile_numel]",
                        {"variable_block_sizes": torch.tensor([8, 6, 8, 8, 5])}),
}
SPELLINGS = {**FLEX_TESTS, **GYM}
# The default tier: trigonometry, bools' bit operators, bit operations on ints, a learnable gather, one
# learnable input gathered at q and at k (whose backward FlexAttention refuses); the rest (and
# tests/test_kernels.py's trig and bit tests) cover the others.
FAST = {"trig2", "dependent_causal_bidirectional", "gym_block_diffusion", "gym_graphormer_edge", "symmetric_bias"}
# and_masks of a mask and its negation allows no key anywhere: building it warns, as it should.
NO_KEY = {"and_masks_empty"}


def _text(name: str) -> str:
    body, _ = SPELLINGS[name]
    return f"attention {name}\n{body}\n"


def _check(text: str, overrides: dict, dtype: torch.dtype = torch.float32) -> None:
    attn = attngen.build(text)
    q, k, v = testing.random_qkv(B, H, HKV, N, N, D, D, dtype, device=DEVICE)
    inputs = testing.random_inputs(attn.spec, B, H, HKV, N, N, device=DEVICE)
    inputs |= {name: value.to(DEVICE) for name, value in overrides.items()}
    testing.check_against_reference(attn.spec, attn, q, k, v, inputs)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else SLOW_IN_INTERPRETER) for n in SPELLINGS])
def test_spelling_matches_the_reference_forward_and_backward(name, dtype):
    with pytest.warns(SpecWarning, match="allows no key") if name in NO_KEY else contextlib.nullcontext():
        _check(_text(name), SPELLINGS[name][1], dtype)


def test_natten_morton_catalog_spec_decodes_morton_order_as_attention_gym_does():
    # attention-gym's decoding: spread the even bits of a code together, 1, 2, 4 and 8 places at a time.
    def deinterleave(code):
        code = code & 0x55555555
        for shift, keep in ((1, 0x33333333), (2, 0x0F0F0F0F), (4, 0x00FF00FF), (8, 0x0000FFFF)):
            code = (code | (code >> shift)) & keep
        return code

    spec = attngen.load_spec(SPECS / "natten_morton.attn")[0]
    params = spec.param_values
    n = params["canvas_w"] * params["canvas_h"]
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    expected = torch.ones(n, n, dtype=torch.bool)
    for shift, canvas, kernel in ((0, "canvas_w", "kernel_w"), (1, "canvas_h", "kernel_h")):
        half = params[kernel] // 2
        center = deinterleave(q >> shift).clamp(half, params[canvas] - 1 - half)
        expected &= (center - deinterleave(k >> shift)).abs() <= half
    env = make_env(spec, B=1, H=1, HKV=1, Q_LEN=n, KV_LEN=n, D=8)
    assert torch.equal(evaluate_expr(spec.mask, env)[0, 0], expected)
    assert int(expected.sum(dim=1).min()) == params["kernel_w"] * params["kernel_h"]


def test_natten_morton_kernels_match_the_reference():
    text = (SPECS / "natten_morton.attn").read_text()
    _check(attngen.with_params(attngen.load_spec(text)[0], {"canvas_w": 8, "canvas_h": 8, "kernel_w": 3,
                                                              "kernel_h": 5}), {})


def test_buffer_reduced():
    # FlexAttention's captured_reduction: score + scale[b].sum(dim=-1)
    _check("attention buffer_reduced\ninput scale_table: f32[B, 8] learnable\nscore: score + sum(scale_table[b, :])\n", {})
