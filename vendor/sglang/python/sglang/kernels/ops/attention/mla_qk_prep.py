import torch
import triton
import triton.language as tl


@triton.jit
def concat_and_cast_mha_k_kernel(
    k_ptr,
    k_nope_ptr,
    k_rope_ptr,
    head_cnt: tl.constexpr,
    k_stride0: tl.constexpr,
    k_stride1: tl.constexpr,
    nope_stride0: tl.constexpr,
    nope_stride1: tl.constexpr,
    rope_stride0: tl.constexpr,
    nope_dim: tl.constexpr,
    rope_dim: tl.constexpr,
):
    pid_loc = tl.program_id(0)
    head_range = tl.arange(0, head_cnt)

    k_head_ptr = k_ptr + pid_loc * k_stride0 + head_range[:, None] * k_stride1

    nope_offs = tl.arange(0, nope_dim)

    src_nope_ptr = (
        k_nope_ptr
        + pid_loc * nope_stride0
        + head_range[:, None] * nope_stride1
        + nope_offs[None, :]
    )
    dst_nope_ptr = k_head_ptr + nope_offs[None, :]

    src_nope = tl.load(src_nope_ptr)
    tl.store(dst_nope_ptr, src_nope)

    rope_offs = tl.arange(0, rope_dim)
    src_rope_ptr = k_rope_ptr + pid_loc * rope_stride0 + rope_offs[None, :]
    dst_rope_ptr = k_head_ptr + nope_dim + rope_offs[None, :]
    src_rope = tl.load(src_rope_ptr)
    tl.store(dst_rope_ptr, src_rope)


@triton.jit
def concat_and_cast_mha_k_pad_kernel(
    k_ptr,
    k_nope_ptr,
    k_rope_ptr,
    head_cnt: tl.constexpr,
    k_stride0: tl.constexpr,
    k_stride1: tl.constexpr,
    nope_stride0: tl.constexpr,
    nope_stride1: tl.constexpr,
    rope_stride0: tl.constexpr,
    nope_dim: tl.constexpr,
    rope_dim: tl.constexpr,
    HEAD_BLOCK: tl.constexpr,
):
    """
    concat_and_cast_mha_k_kernel for a head count that is not a power of two.
    tl.arange needs a power-of-two extent, so walk HEAD_BLOCK == next_power_of_2(head_cnt)
    lanes and mask the tail.
    """
    pid_loc = tl.program_id(0)
    head_range = tl.arange(0, HEAD_BLOCK)
    head_mask = head_range < head_cnt

    k_head_ptr = k_ptr + pid_loc * k_stride0 + head_range[:, None] * k_stride1

    nope_offs = tl.arange(0, nope_dim)

    src_nope_ptr = (
        k_nope_ptr
        + pid_loc * nope_stride0
        + head_range[:, None] * nope_stride1
        + nope_offs[None, :]
    )
    dst_nope_ptr = k_head_ptr + nope_offs[None, :]

    nope_mask = tl.broadcast_to(head_mask[:, None], (HEAD_BLOCK, nope_dim))
    src_nope = tl.load(src_nope_ptr, mask=nope_mask, other=0)
    tl.store(dst_nope_ptr, src_nope, mask=nope_mask)

    rope_offs = tl.arange(0, rope_dim)
    src_rope_ptr = k_rope_ptr + pid_loc * rope_stride0 + rope_offs[None, :]
    dst_rope_ptr = k_head_ptr + nope_dim + rope_offs[None, :]
    rope_mask = tl.broadcast_to(head_mask[:, None], (HEAD_BLOCK, rope_dim))
    src_rope = tl.load(src_rope_ptr)
    tl.store(
        dst_rope_ptr,
        tl.broadcast_to(src_rope, (HEAD_BLOCK, rope_dim)),
        mask=rope_mask,
    )


def concat_and_cast_mha_k_triton(
    k: torch.Tensor,
    k_nope: torch.Tensor,
    k_rope: torch.Tensor,
):
    # The source data type will be implicitly converted to the target data type.
    assert len(k.shape) == 3 and len(k_nope.shape) == 3 and len(k_rope.shape) == 3, (
        f"shape should be 3d, but got {k.shape=}, {k_nope.shape=}, {k_rope.shape=}"
    )
    assert k.shape[0] == k_nope.shape[0] and k.shape[0] == k_rope.shape[0], (
        f"invalid shape, got {k.shape=}, {k_nope.shape=}, {k_rope.shape=}"
    )
    assert k.shape[1] == k_nope.shape[1] and 1 == k_rope.shape[1], (
        f"invalid shape, got {k.shape=}, {k_nope.shape=}, {k_rope.shape=}"
    )
    assert k.shape[-1] == k_nope.shape[-1] + k_rope.shape[-1], (
        f"invalid shape, got {k.shape=}, {k_nope.shape=}, {k_rope.shape=}"
    )

    nope_dim = k_nope.shape[-1]
    rope_dim = k_rope.shape[-1]
    grid = (k.shape[0],)

    head_cnt = k.shape[1]
    if head_cnt != triton.next_power_of_2(head_cnt):
        # Not the power of two concat_and_cast_mha_k_kernel's tl.arange needs;
        # Kimi-K3's 96 heads give 12 at TP8.
        concat_and_cast_mha_k_pad_kernel[grid](
            k,
            k_nope,
            k_rope,
            head_cnt,
            k.stride(0),
            k.stride(1),
            k_nope.stride(0),
            k_nope.stride(1),
            k_rope.stride(0),
            nope_dim,
            rope_dim,
            HEAD_BLOCK=triton.next_power_of_2(head_cnt),
        )
        return

    concat_and_cast_mha_k_kernel[grid](
        k,
        k_nope,
        k_rope,
        k.shape[1],
        k.stride(0),
        k.stride(1),
        k_nope.stride(0),
        k_nope.stride(1),
        k_rope.stride(0),
        nope_dim,
        rope_dim,
    )


@triton.jit
def concat_and_cast_q_fp8_pad_kernel(
    qpad_ptr,  # [num_tokens, pad_heads, NOPE+ROPE] fp8 (dst; only [:, :H, :] written)
    q_nope_ptr,  # [num_tokens, H, NOPE] bf16
    q_rope_ptr,  # [num_tokens, H, ROPE] bf16
    qpad_s0,
    qpad_s1,
    nope_s0,
    nope_s1,
    rope_s0,
    rope_s1,
    H: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
):
    # One program per token: write the H active heads of the padded fp8 q buffer,
    # fusing the bf16->fp8 cast (on store) with the nope/rope concat.  Bit-exact vs the
    # two strided copy_() it replaces; ~3.7x faster because copy_ into the
    # 64-head-padded buffer is strided (~4.5x off memory-bound).  Strides are passed in,
    # so q_nope/q_rope may be views of a [T, H, NOPE+ROPE] q (head-stride != last-dim).
    pid = tl.program_id(0)
    hr = tl.arange(0, H)
    qpad_head = qpad_ptr + pid * qpad_s0 + hr[:, None] * qpad_s1
    no = tl.arange(0, NOPE)
    src_n = tl.load(q_nope_ptr + pid * nope_s0 + hr[:, None] * nope_s1 + no[None, :])
    tl.store(qpad_head + no[None, :], src_n)
    # NoPE models pass ROPE=0; tl.arange rejects empty ranges, so skip statically.
    if ROPE > 0:
        ro = tl.arange(0, ROPE)
        src_r = tl.load(
            q_rope_ptr + pid * rope_s0 + hr[:, None] * rope_s1 + ro[None, :]
        )
        tl.store(qpad_head + NOPE + ro[None, :], src_r)


def concat_and_cast_q_fp8_pad(q_fp8_pad, q_nope, q_rope, num_heads):
    """fused bf16->fp8 concat-cast of q_nope/q_rope into the active
    [:, :num_heads, :] slice of the padded fp8 q buffer.  Bit-exact replacement for the
    two strided converting copy_() in the Q8KV8 prefill q-prep, ~3.7x faster.  Requires
    num_heads / nope_dim / rope_dim to be powers of two (always true for DeepSeek: 128
    heads / any TP, 512 nope, 64 rope); rope_dim may also be 0 for NoPE models."""
    num_tokens = q_nope.shape[0]
    nope_dim = q_nope.shape[-1]
    rope_dim = q_rope.shape[-1]
    concat_and_cast_q_fp8_pad_kernel[(num_tokens,)](
        q_fp8_pad,
        q_nope,
        q_rope,
        q_fp8_pad.stride(0),
        q_fp8_pad.stride(1),
        q_nope.stride(0),
        q_nope.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        H=num_heads,
        NOPE=nope_dim,
        ROPE=rope_dim,
    )


@triton.jit
def absorbed_bmm_concat_cast_q_fp8_kernel(
    qout_ptr,  # [num_tokens, pad_heads, N+ROPE] fp8 (dst; only [:, :H, :] written)
    a_ptr,  # q_nope (pre-absorb) [num_tokens, H, K] bf16
    b_ptr,  # w_kc [H, K, N] bf16 (any strides; typically N-major)
    rope_ptr,  # q_rope (post-rope) [num_tokens, H, ROPE] bf16
    T,  # num_tokens (runtime; masked)
    qout_s0,
    qout_s1,
    a_s0,
    a_s1,
    b_s0,
    b_s1,
    b_s2,
    rope_s0,
    rope_s1,
    K: tl.constexpr,
    N: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_MODE: tl.constexpr,
):
    # One program per (token-block, head): q_out[m, h, :N] = fp8(bf16(fp32(
    # q_nope[m, h, :K] @ w_kc[h, :K, :N]))) and q_out[m, h, N:] =
    # fp8(q_rope[m, h, :ROPE]).  This makes q "born fp8": the absorbed bmm,
    # the nope/rope concat, and the bf16->fp8 cast collapse into one kernel,
    # so neither the bf16 q_nope_out ([H, T, N], written by cublas and re-read
    # by the concat-cast) nor the standalone concat-cast launch exist anymore.
    #
    # K handling (K_MODE selects the codegen for the nope-gemm K dimension;
    # every mode keeps the same fp32-accumulator -> bf16 -> fp8 epilogue):
    #   0 "single": BLOCK_K == K.  Preload the whole [BLOCK_M, K] a-tile once,
    #     one tl.dot per N-block — identical codegen to the original
    #     power-of-2-only kernel (DeepSeek K=128).  For non-power-of-2 K this
    #     only compiles if the Triton build allows non-power-of-2 tl.arange
    #     (Triton <= 3.5.x does NOT: "arange's range must be a power of 2").
    #   1 "loop": split-K loop, K % BLOCK_K == 0, BLOCK_K power of 2 >= 16
    #     (e.g. K=192 with BLOCK_K=64 -> 3 iterations).  The a-tile is
    #     re-loaded per (N-block, K-block); slices are L1/L2-resident after
    #     the first N-block, but the load/dot interleave costs bandwidth
    #     (measured ~1372 GB/s vs ~2x that for mode 0 at K=128).
    #   2 "two_dot": K = BLOCK_K + (K - BLOCK_K), both power-of-2 halves
    #     (192 = 128 + 64).  Both a-tiles preload once before the N-loop;
    #     each N-block issues two chained tl.dot into one fp32 accumulator.
    #     No K-loop, no a re-reads — the direct generalization of mode 0.
    #   3 "three_dot": K = 3 * BLOCK_K (192 = 3 x 64).  Same as mode 2 with
    #     three preloaded a-tiles / three chained tl.dot per N-block; the
    #     hoisted-loads analogue of mode 1 (identical fp32 add order).
    #   4 "pad": BLOCK_K = next_pow2(K) > K, k-masked loads (zero fill).
    #     Single tl.dot per N-block; the padded zeros are exact fp32
    #     additive identities so the result matches a K-wide single dot,
    #     at the cost of BLOCK_K/K (e.g. 256/192 = 1.33x) extra MMA work.
    #
    # Rounding contract: the fp32 accumulator is rounded to bf16 first (the
    # same output rounding stage as the cublas bf16 bmm) and then converted
    # bf16->fp8 by the same implicit-store conversion the fused concat-cast
    # kernel uses.  The split-K accumulator stays fp32 across all K-blocks,
    # so the rounding stages are identical in both layouts.  The rope half is
    # a bit-exact copy of that kernel (loads the post-rope bf16, converts on
    # store).  The nope half is NOT guaranteed bit-exact vs the default path:
    # tl.dot accumulates fp32 in a different order than cublas, so last-ulp
    # fp32 differences can occasionally flip the bf16 (and hence fp8)
    # rounding.
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < T
    # token-row offsets in int64: T * row-stride can exceed int32 (e.g. 128
    # heads x 576 dims x tens of thousands of tokens).
    offs_m64 = offs_m.to(tl.int64)
    qout_head = qout_ptr + offs_m64[:, None] * qout_s0 + h * qout_s1
    a_row = a_ptr + offs_m64[:, None] * a_s0 + h * a_s1
    b_head = b_ptr + h * b_s0
    if K_MODE == 0:
        # single-dot path (original kernel): BLOCK_K == K, preload a once.
        offs_k = tl.arange(0, BLOCK_K)
        a = tl.load(a_row + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        for nb in tl.static_range(N // BLOCK_N):
            offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            b = tl.load(b_head + offs_k[:, None] * b_s1 + offs_n[None, :] * b_s2)
            acc = tl.dot(a, b)  # fp32 accumulator
            val = acc.to(tl.bfloat16)  # cublas-equivalent bf16 output rounding
            # implicit bf16 -> fp8 conversion on store (same as the concat-cast)
            tl.store(qout_head + offs_n[None, :], val, mask=m_mask[:, None])
    elif K_MODE == 2:
        # two-dot preload: K split as BLOCK_K + (K - BLOCK_K), no K-loop.
        offs_k0 = tl.arange(0, BLOCK_K)
        offs_k1 = BLOCK_K + tl.arange(0, K - BLOCK_K)
        a0 = tl.load(a_row + offs_k0[None, :], mask=m_mask[:, None], other=0.0)
        a1 = tl.load(a_row + offs_k1[None, :], mask=m_mask[:, None], other=0.0)
        for nb in tl.static_range(N // BLOCK_N):
            offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            b0 = tl.load(b_head + offs_k0[:, None] * b_s1 + offs_n[None, :] * b_s2)
            b1 = tl.load(b_head + offs_k1[:, None] * b_s1 + offs_n[None, :] * b_s2)
            acc = tl.dot(a0, b0)  # fp32 accumulator
            acc = tl.dot(a1, b1, acc)  # chained: stays fp32 across both dots
            val = acc.to(tl.bfloat16)  # cublas-equivalent bf16 output rounding
            # implicit bf16 -> fp8 conversion on store (same as the concat-cast)
            tl.store(qout_head + offs_n[None, :], val, mask=m_mask[:, None])
    elif K_MODE == 3:
        # three-dot preload: K = 3 * BLOCK_K, a-tiles hoisted out of the N-loop.
        offs_k0 = tl.arange(0, BLOCK_K)
        offs_k1 = BLOCK_K + offs_k0
        offs_k2 = 2 * BLOCK_K + offs_k0
        a0 = tl.load(a_row + offs_k0[None, :], mask=m_mask[:, None], other=0.0)
        a1 = tl.load(a_row + offs_k1[None, :], mask=m_mask[:, None], other=0.0)
        a2 = tl.load(a_row + offs_k2[None, :], mask=m_mask[:, None], other=0.0)
        for nb in tl.static_range(N // BLOCK_N):
            offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            b0 = tl.load(b_head + offs_k0[:, None] * b_s1 + offs_n[None, :] * b_s2)
            b1 = tl.load(b_head + offs_k1[:, None] * b_s1 + offs_n[None, :] * b_s2)
            b2 = tl.load(b_head + offs_k2[:, None] * b_s1 + offs_n[None, :] * b_s2)
            acc = tl.dot(a0, b0)  # fp32 accumulator
            acc = tl.dot(a1, b1, acc)
            acc = tl.dot(a2, b2, acc)  # same fp32 add order as the K_MODE=1 loop
            val = acc.to(tl.bfloat16)  # cublas-equivalent bf16 output rounding
            # implicit bf16 -> fp8 conversion on store (same as the concat-cast)
            tl.store(qout_head + offs_n[None, :], val, mask=m_mask[:, None])
    elif K_MODE == 4:
        # padded single dot: BLOCK_K = next_pow2(K), zero-fill the k tail.
        offs_k = tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(
            a_row + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        for nb in tl.static_range(N // BLOCK_N):
            offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            b = tl.load(
                b_head + offs_k[:, None] * b_s1 + offs_n[None, :] * b_s2,
                mask=k_mask[:, None],
                other=0.0,
            )
            acc = tl.dot(a, b)  # fp32 accumulator (padded zeros add exactly 0)
            val = acc.to(tl.bfloat16)  # cublas-equivalent bf16 output rounding
            # implicit bf16 -> fp8 conversion on store (same as the concat-cast)
            tl.store(qout_head + offs_n[None, :], val, mask=m_mask[:, None])
    else:
        # K_MODE == 1: split-K loop (K % BLOCK_K == 0, e.g. K=192, BLOCK_K=64).
        for nb in tl.static_range(N // BLOCK_N):
            offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kb in tl.static_range(K // BLOCK_K):
                offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
                a = tl.load(a_row + offs_k[None, :], mask=m_mask[:, None], other=0.0)
                b = tl.load(b_head + offs_k[:, None] * b_s1 + offs_n[None, :] * b_s2)
                acc = tl.dot(a, b, acc)  # fp32 accumulator across K-blocks
            val = acc.to(tl.bfloat16)  # cublas-equivalent bf16 output rounding
            # implicit bf16 -> fp8 conversion on store (same as the concat-cast)
            tl.store(qout_head + offs_n[None, :], val, mask=m_mask[:, None])
    offs_r = tl.arange(0, ROPE)
    r = tl.load(
        rope_ptr + offs_m64[:, None] * rope_s0 + h * rope_s1 + offs_r[None, :],
        mask=m_mask[:, None],
        other=0.0,
    )
    tl.store(qout_head + N + offs_r[None, :], r, mask=m_mask[:, None])


# Non-power-of-2-K variant used by variant="auto" (power-of-2 K always takes
# the single-dot fast path).  Set to the winner of the K=192 A/B in
# benchmark/kernels/deepseek/benchmark_q8kv8_q_prep.py; "loop" = the pre-A/B split-K behavior.
_AUTO_NONPOW2_VARIANT = "two_dot"


def _qprep_env_variant():
    from sglang.srt.environ import envs

    return envs.SGLANG_OPT_Q8KV8_QPREP_VARIANT.get()


# Resolved once at import (matches the module-constant style above).  "auto"
# keeps the per-K dispatch; "cuda" routes every shape to the hand-written
# SM90 WGMMA kernel (bitwise-identical to two_dot; 1.16-1.38x faster).
_ENV_QPREP_VARIANT = None


def absorbed_bmm_concat_cast_q_fp8(
    q_fp8_pad: "torch.Tensor",
    q_nope: "torch.Tensor",
    w_kc: "torch.Tensor",
    q_rope: "torch.Tensor",
    num_heads: int,
    block_m: int = 128,
    block_n: int = 64,
    variant: str = "auto",
    block_k: int = 0,
    num_warps: int = 8,
    num_stages: int = 0,
):
    """Fused absorbed-q bmm + nope/rope concat + bf16->fp8 cast ("born fp8" q).

    Replaces ``torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1)``
    followed by ``concat_and_cast_q_fp8_pad`` on the Q8KV8 sparse-prefill
    path, writing the active ``[:, :num_heads, :]`` slice of the padded fp8 q
    buffer directly.  Inputs:

    * ``q_fp8_pad``: [num_tokens, pad_heads, N + ROPE] fp8_e4m3 destination.
    * ``q_nope``: [num_tokens, H, K] bf16 pre-absorb q (strided views OK).
    * ``w_kc``: [H, K, N] bf16 absorbed weight (any strides).
    * ``q_rope``: [num_tokens, H, ROPE] bf16 post-rope q (strided views OK).

    The rope half is bit-exact vs ``concat_and_cast_q_fp8_pad``.  The nope
    half keeps the same rounding stages (fp32 accum -> bf16 -> fp8) but a
    different fp32 accumulation order than cublas, so it is near- but not
    guaranteed bit-exact; keep this path behind
    ``SGLANG_ENABLE_DSA_Q8KV8_BORN_FP8_Q``.

    K (``qk_nope_head_dim``) supports any multiple of 16 in [16, 256].
    Power-of-2 K (DeepSeek 128) always takes the preload-once
    single-``tl.dot`` path.  For other K (GLM 192), ``variant`` selects the
    K-dimension codegen (every variant keeps the identical fp32 -> bf16 ->
    fp8 epilogue):

    * ``"auto"``: the current production choice (see
      ``_AUTO_NONPOW2_VARIANT``).
    * ``"loop"``: split-K accumulator loop, ``BLOCK_K`` = ``block_k`` or the
      largest power-of-2 divisor of K capped at 128 (192 -> 64 x 3).
    * ``"two_dot"``: preload a as two power-of-2 tiles (192 = 128 + 64), two
      chained ``tl.dot`` per N-block, no K-loop.
    * ``"three_dot"``: preload a as three K/3 tiles (192 = 3 x 64), three
      chained ``tl.dot`` per N-block; same fp32 add order as ``"loop"``.
    * ``"pad"``: single ``tl.dot`` with ``BLOCK_K`` = next_pow2(K) (192 ->
      256) and zero-masked k tails.
    * ``"single_k"``: single ``tl.dot`` with ``BLOCK_K`` == K.  Only
      compiles if the Triton build supports non-power-of-2 ``tl.arange``
      (Triton <= 3.5.x raises "arange's range must be a power of 2").
    ``block_m`` / ``block_n`` / ``num_warps`` / ``num_stages`` are tuning
    knobs for the microbench sweep (0 = Triton default for ``num_stages``).
    """
    num_tokens, _, k_dim = q_nope.shape
    n_dim = w_kc.shape[-1]
    rope_dim = q_rope.shape[-1]
    assert q_fp8_pad.dtype == torch.float8_e4m3fn
    assert q_nope.dtype == torch.bfloat16 and w_kc.dtype == torch.bfloat16
    assert q_rope.dtype == torch.bfloat16
    assert q_nope.shape[1] == num_heads and q_rope.shape[1] == num_heads
    assert w_kc.shape[0] == num_heads and w_kc.shape[1] == k_dim
    assert q_fp8_pad.shape[0] >= num_tokens and q_fp8_pad.shape[1] >= num_heads
    assert q_fp8_pad.shape[2] == n_dim + rope_dim
    # tl.arange / tl.dot constraints
    assert k_dim % 16 == 0 and 16 <= k_dim <= 256, (
        "K must be a multiple of 16 in [16, 256]"
    )
    assert (rope_dim & (rope_dim - 1)) == 0, "ROPE must be a power of two"
    assert n_dim % block_n == 0, "N must be a multiple of block_n"
    assert q_nope.stride(2) == 1 and q_rope.stride(2) == 1
    assert q_fp8_pad.stride(2) == 1
    # Env override for production dispatch (SGLANG_OPT_Q8KV8_QPREP_VARIANT):
    # "auto" (default) keeps the per-K Triton dispatch; "cuda" routes every
    # shape to the WGMMA kernel below.
    global _ENV_QPREP_VARIANT
    if _ENV_QPREP_VARIANT is None:
        _ENV_QPREP_VARIANT = _qprep_env_variant()
    if variant == "auto" and _ENV_QPREP_VARIANT != "auto":
        variant = _ENV_QPREP_VARIANT
    # Hand-written SM90 WGMMA kernel (opt-in only; "auto" never routes here).
    # Same fp32 -> bf16 -> fp8 epilogue; bitwise identical to "two_dot" on
    # SM90.  Requires K in {128, 192} and the production N-major w_kc layout
    # (see the wrapper's asserts); the Triton variants remain the
    # general-strides fallback.
    _valid = ("auto", "cuda", "loop", "two_dot", "three_dot", "pad", "single_k")
    if variant not in _valid:
        raise ValueError(
            f"unknown q-prep variant {variant!r} "
            f"(SGLANG_OPT_Q8KV8_QPREP_VARIANT); valid: {_valid}"
        )
    if variant == "cuda":
        from sglang.kernels.ops.attention.qprep_bf16_fp8_sm90 import q8kv8_qprep_fwd

        q8kv8_qprep_fwd(q_fp8_pad, q_nope, w_kc, q_rope, num_heads)
        return
    # Resolve (K_MODE, BLOCK_K) from the variant; see the kernel's K-handling
    # comment for what each mode compiles to.
    if k_dim & (k_dim - 1) == 0:
        # power-of-2 K: every variant collapses to the single-dot fast path.
        k_mode, blk_k = 0, k_dim
    else:
        v = _AUTO_NONPOW2_VARIANT if variant == "auto" else variant
        if v == "loop":
            # Largest power-of-2 divisor of K, capped at 128 (K % 16 == 0
            # makes this >= 16), unless the caller pinned block_k.
            blk_k = block_k or min(k_dim & -k_dim, 128)
            assert k_dim % blk_k == 0 and blk_k & (blk_k - 1) == 0 and blk_k >= 16, (
                "loop needs BLOCK_K a power-of-2 divisor of K >= 16"
            )
            k_mode = 1
        elif v == "two_dot":
            blk_k = 1 << (k_dim.bit_length() - 1)  # largest power of 2 < K
            k1 = k_dim - blk_k
            assert k1 & (k1 - 1) == 0 and k1 >= 16, (
                "two_dot needs K = pow2 + pow2 with both halves >= 16"
            )
            k_mode = 2
        elif v == "three_dot":
            blk_k = k_dim // 3
            assert k_dim % 3 == 0 and blk_k & (blk_k - 1) == 0 and blk_k >= 16, (
                "three_dot needs K = 3 * pow2 with pow2 >= 16"
            )
            k_mode = 3
        elif v == "pad":
            blk_k = 1 << k_dim.bit_length()  # next power of 2 above K
            k_mode = 4
        elif v == "single_k":
            # Non-power-of-2 BLOCK_K == K: compiles only on Triton builds
            # that allow non-power-of-2 tl.arange (not 3.5.x).
            blk_k = k_dim
            k_mode = 0
        else:
            raise ValueError(f"unknown absorbed-bmm K variant: {variant!r}")
    extra = {"num_stages": num_stages} if num_stages else {}
    grid = (triton.cdiv(num_tokens, block_m), num_heads)
    absorbed_bmm_concat_cast_q_fp8_kernel[grid](
        q_fp8_pad,
        q_nope,
        w_kc,
        q_rope,
        num_tokens,
        q_fp8_pad.stride(0),
        q_fp8_pad.stride(1),
        q_nope.stride(0),
        q_nope.stride(1),
        w_kc.stride(0),
        w_kc.stride(1),
        w_kc.stride(2),
        q_rope.stride(0),
        q_rope.stride(1),
        K=k_dim,
        N=n_dim,
        ROPE=rope_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=blk_k,
        K_MODE=k_mode,
        num_warps=num_warps,
        **extra,
    )
