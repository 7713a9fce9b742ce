#include <sgl_kernel/tensor.h>
#include <sgl_kernel/utils.h>

#include <sgl_kernel/math.cuh>
#include <sgl_kernel/runtime.cuh>
#include <sgl_kernel/tile.cuh>
#include <sgl_kernel/type.cuh>
#include <sgl_kernel/utils.cuh>
#include <sgl_kernel/vec.cuh>
#include <sgl_kernel/warp.cuh>

#include <sgl_kernel/deepseek_v4/fp8_utils.cuh>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cuda_fp8.h>
#include <type_traits>

namespace sglang {

using deepseek_v4::fp8::cast_to_ue8m0;
using deepseek_v4::fp8::pack_fp8;

struct SiluMulQuantVarlenParams {
  const bf16_t* __restrict__ input;
  fp8_e4m3_t* __restrict__ output;
  float* __restrict__ output_scale;
  const int32_t* __restrict__ masked_m;
  float swiglu_limit;  // only read when kApplySwigluLimit=true
  int64_t hidden_dim;
  uint32_t num_tokens;
  uint32_t num_experts;
  uint32_t max_rows;  // num_tokens * topk; rows past it are left unwritten
};

constexpr uint32_t kMaxExperts = 256;

template <bool kApplySwigluLimit, bool kPrecise = true, typename DType2>
SGL_DEVICE fp32x2_t silu_and_mul(DType2 gate, DType2 up, float limit) {
  using namespace device;
  // refer to as implementation. TL;DR: must clamp in bf16
  // https://github.com/deepseek-ai/DeepGEMM/blob/7f2a703ed51ac1f7af07f5e1453b2d3267d37d50/deep_gemm/include/deep_gemm/impls/sm100_fp8_fp4_mega_moe.cuh#L984-L997
  if constexpr (kApplySwigluLimit) {
    static_assert(std::is_same_v<DType2, bf16x2_t>);
    gate = __hmin2(gate, {limit, limit});
    up = __hmax2(up, {-limit, -limit});
    up = __hmin2(up, {limit, limit});
  }
  const auto [g0, g1] = cast<fp32x2_t>(gate);
  const auto [u0, u1] = cast<fp32x2_t>(up);
  const auto silu0 = g0 / (1.0f + __expf(-g0));
  const auto silu1 = g1 / (1.0f + __expf(-g1));
  const float val0 = silu0 * u0;
  const float val1 = silu1 * u1;
  if constexpr (kPrecise) {  // I don't know if we should enable this?
    return {val0, val1};
  } else {
    return cast<fp32x2_t>(cast<bf16x2_t>(fp32x2_t{val0, val1}));
  }
}

// Writes the inclusive prefix sum of `masked_m` to `s_row_end` and returns the total row count.
// Expert e owns rows [s_row_end[e - 1], s_row_end[e]) of the flattened real-row index.
// Requires blockDim.x >= params.num_experts and params.num_experts <= kMaxExperts.
SGL_DEVICE uint32_t scan_masked_m(const SiluMulQuantVarlenParams& params, uint32_t* s_row_end) {
  using namespace device;
  static_assert(kWarpThreads == 32);

  static __shared__ uint32_t s_warp_sum[32];

  const uint32_t tx = threadIdx.x;
  const uint32_t lane_id = tx % kWarpThreads;
  const uint32_t warp_id = tx / kWarpThreads;

  const uint32_t val = tx < params.num_experts ? params.masked_m[tx] : 0u;

  // Per-warp inclusive scan of masked_m.
  const uint32_t warp_inclusive = warp::inclusive_sum(val, lane_id);

  // Write each warp total.
  if (lane_id == kWarpThreads - 1) s_warp_sum[warp_id] = warp_inclusive;
  __syncthreads();
  const auto tmp_val = lane_id < warp_id ? s_warp_sum[lane_id] : 0u;
  const auto prefix_inclusive = warp::reduce_sum(tmp_val) + warp_inclusive;
  if (tx < params.num_experts) s_row_end[tx] = prefix_inclusive;
  __syncthreads();
  return params.num_experts == 0 ? 0u : s_row_end[params.num_experts - 1];
}

// Returns the expert that owns flattened real row `row`, which must be below s_row_end[num_experts - 1].
SGL_DEVICE uint32_t find_expert(const uint32_t* s_row_end, uint32_t num_experts, uint32_t row) {
  uint32_t lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const uint32_t mid = (lo + hi) / 2;
    if (s_row_end[mid] > row) {
      hi = mid;
    } else {
      lo = mid + 1;
    }
  }
  return lo;
}

template <uint32_t kGroupSize, bool kScaleUE8M0, bool kTransposed, bool kSwizzle, bool kUsePDL, bool kApplySwigluLimit>
SGL_DEVICE void
silu_mul_quant_varlen_row(const SiluMulQuantVarlenParams& params, const uint32_t expert_id, const uint32_t token_id) {
  using namespace device;

  constexpr uint32_t kWorkThreads = kGroupSize / 8u;
  // each thread will handle 8 elements
  using InputVec = AlignedVector<bf16x2_t, 4>;
  using OutputVec = AlignedVector<fp8x2_e4m3_t, 4>;
  static_assert(kGroupSize == 32 || kGroupSize == 128, "unsupported group_size");
  static_assert(!(kTransposed && !kScaleUE8M0), "transposed layout only supports ue8m0");

  const auto work_id = threadIdx.x / kWorkThreads;

  const auto offset = expert_id * params.num_tokens + token_id;
  const auto input = params.input + offset * params.hidden_dim * 2;
  const auto output = params.output + offset * params.hidden_dim;
  [[maybe_unused]]
  const auto output_scale = [&] {
    const auto num_groups = params.hidden_dim / kGroupSize;
    if constexpr (kTransposed) {
      const auto base = reinterpret_cast<uint8_t*>(params.output_scale);
      // Physical layout is [E, G//4, N] int32.  Each int32 packs 4 consecutive
      // group scales for the same token, so the byte address is:
      //   expert_offset + (group/4)*N*4 + token*4 + group%4
      return base + expert_id * num_groups * params.num_tokens + (work_id / 4u) * (params.num_tokens * 4u) +
             token_id * 4u + (work_id % 4u);
    } else {
      return params.output_scale + offset * num_groups + work_id;
    }
  }();

  InputVec gate_vec, up_vec;
  if constexpr (kSwizzle) {
    // gran=8 interleaved: every 16-element chunk on the N axis is
    // [gate[0..7], up[0..7]]. Each thread handles 8 consecutive output
    // elements, so its gate chunk lives at vec index 2*threadIdx.x and its
    // up chunk at 2*threadIdx.x+1.
    gate_vec.load(input, threadIdx.x * 2);
    up_vec.load(input, threadIdx.x * 2 + 1);
  } else {
    gate_vec.load(input, threadIdx.x);
    up_vec.load(input, threadIdx.x + blockDim.x);
  }

  float local_max = 0.0f;
  float results[8];

#pragma unroll
  for (uint32_t i = 0; i < 4; ++i) {
    const auto [x, y] = silu_and_mul<kApplySwigluLimit>(gate_vec[i], up_vec[i], params.swiglu_limit);
    results[2 * i + 0] = x;
    results[2 * i + 1] = y;
    local_max = fmaxf(local_max, fmaxf(fabsf(x), fabsf(y)));
  }

  local_max = warp::reduce_max<kWorkThreads>(local_max);

  const float absmax = fmaxf(local_max, 1e-10f);
  float scale;
  uint32_t ue8m0_exp;

  if constexpr (kScaleUE8M0) {
    const float raw_scale = absmax / math::FP8_E4M3_MAX;
    ue8m0_exp = cast_to_ue8m0(raw_scale);
    scale = __uint_as_float(ue8m0_exp << 23);
  } else {
    scale = absmax / math::FP8_E4M3_MAX;
  }
  const auto inv_scale = 1.0f / scale;

  OutputVec out_vec;
#pragma unroll
  for (uint32_t i = 0; i < 4; ++i) {
    const float scaled_val0 = results[2 * i + 0] * inv_scale;
    const float scaled_val1 = results[2 * i + 1] * inv_scale;
    out_vec[i] = pack_fp8(scaled_val0, scaled_val1);
  }

  PDLTriggerSecondary<kUsePDL>();

  out_vec.store(output, threadIdx.x);
  if constexpr (kTransposed) {
    *output_scale = ue8m0_exp;
  } else {
    *output_scale = scale;
  }
}

// Persistent: the host sizes the grid to the resident CTAs, not to num_tokens * topk,
// because masked_m lives on the device and most of the padded capacity is empty.
template <uint32_t kGroupSize, bool kScaleUE8M0, bool kTransposed, bool kSwizzle, bool kUsePDL, bool kApplySwigluLimit>
__global__ __launch_bounds__(1024, 2) void  // maximize occupancy
    silu_mul_quant_varlen_kernel(const SiluMulQuantVarlenParams __grid_constant__ params) {
  using namespace device;

  __shared__ uint32_t s_row_end[kMaxExperts];
  const uint32_t num_rows = min(scan_masked_m(params, s_row_end), params.max_rows);
  if (blockIdx.x >= num_rows) return;

  PDLWaitPrimary<kUsePDL>();

  for (uint32_t row = blockIdx.x; row < num_rows; row += gridDim.x) {
    const uint32_t expert_id = find_expert(s_row_end, params.num_experts, row);
    const uint32_t row_begin = expert_id == 0 ? 0u : s_row_end[expert_id - 1];
    silu_mul_quant_varlen_row<kGroupSize, kScaleUE8M0, kTransposed, kSwizzle, kUsePDL, kApplySwigluLimit>(
        params, expert_id, row - row_begin);
  }
}

struct SiluAndMulClampParams {
  const void* __restrict__ input;
  void* __restrict__ output;
  float swiglu_limit;
  uint32_t out_vecs;
  uint32_t blocks_per_row;
};

template <typename DType2>
SGL_DEVICE bf16x2_t to_bf16x2(DType2 value) {
  if constexpr (std::is_same_v<DType2, bf16x2_t>) {
    return value;
  } else {
    return device::cast<bf16x2_t>(device::cast<fp32x2_t>(value));
  }
}

template <typename DType, bool kUsePDL>
__global__ __launch_bounds__(1024, 2) void  // maximize occupancy
    silu_mul_clamp_kernel(const SiluAndMulClampParams __grid_constant__ params) {
  using namespace device;
  static_assert(sizeof(DType) == 2, "only fp16/bf16 supported");
  using DType2 = packed_t<DType>;
  constexpr auto kVecSize = 16 / sizeof(DType);
  static_assert(kVecSize % 2 == 0 && kVecSize > 0);
  using Vec = AlignedVector<DType2, kVecSize / 2>;
  const auto row = blockIdx.x / params.blocks_per_row;
  const auto block_in_row = blockIdx.x % params.blocks_per_row;
  const auto vec_id = block_in_row * blockDim.x + threadIdx.x;
  const float limit = params.swiglu_limit;

  PDLWaitPrimary<kUsePDL>();
  if (vec_id < params.out_vecs) {
    const auto input = static_cast<const Vec*>(params.input);
    auto output = static_cast<Vec*>(params.output);
    const auto input_row = row * 2 * params.out_vecs;
    const auto gate = input[input_row + vec_id];
    const auto up = input[input_row + params.out_vecs + vec_id];
    Vec out;

#pragma unroll
    for (uint32_t i = 0; i < kVecSize / 2; ++i) {
      out[i] = cast<DType2>(silu_and_mul<true>(to_bf16x2(gate[i]), to_bf16x2(up[i]), limit));
    }

    output[row * params.out_vecs + vec_id] = out;
  }
  PDLTriggerSecondary<kUsePDL>();
}

// ---- Host wrapper
// ------------------------------------------------------------------------------------------------------------------------

template <int64_t kGroupSize, bool kScaleUE8M0, bool kSwizzle, bool kUsePDL, bool kApplySwigluLimit>
struct SiluAndMulMaskedPostQuantKernel {
  static_assert(kGroupSize == 32 || kGroupSize == 128);
  static constexpr auto kernel_normal =
      silu_mul_quant_varlen_kernel<kGroupSize, kScaleUE8M0, false, kSwizzle, kUsePDL, kApplySwigluLimit>;
  static constexpr auto kernel_transposed =
      silu_mul_quant_varlen_kernel<kGroupSize, true, true, kSwizzle, kUsePDL, kApplySwigluLimit>;

  static void
  run(const tvm::ffi::TensorView input,
      const tvm::ffi::TensorView output,
      const tvm::ffi::TensorView output_scale,
      const tvm::ffi::TensorView masked_m,
      const uint32_t topk,
      const bool transposed,
      const double swiglu_limit) {
    using namespace host;

    auto device = SymbolicDevice{};
    auto E = SymbolicSize{"num_experts"};
    auto T = SymbolicSize{"num_tokens_padded"};
    auto D = SymbolicSize{"hidden_dim x 2"};
    auto N = SymbolicSize{"hidden_dim"};
    auto G = SymbolicSize{"num_groups"};
    device.set_options<kDLCUDA>();

    TensorMatcher({E, T, D})  // input
        .with_dtype<bf16_t>()
        .with_device(device)
        .verify(input);
    TensorMatcher({E, T, N})  // output
        .with_dtype<fp8_e4m3_t>()
        .with_device(device)
        .verify(output);
    if (!transposed) {
      TensorMatcher({E, T, G})  //
          .with_dtype<fp32_t>()
          .with_device(device)
          .verify(output_scale);
    } else {
      RuntimeCheck(kScaleUE8M0, "transposed layout only supports scale_ue8m0=true");
      auto G_ = SymbolicSize{"G // 4"};
      TensorMatcher({E, G_, T})  //
          .with_dtype<int32_t>()
          .with_device(device)
          .verify(output_scale);
      G.set_value(G_.unwrap() * 4);
    }
    TensorMatcher({E})  //
        .with_dtype<int32_t>()
        .with_device(device)
        .verify(masked_m);

    const auto num_experts = static_cast<uint32_t>(E.unwrap());
    const auto num_tokens = static_cast<uint32_t>(T.unwrap());
    const auto num_groups = static_cast<uint32_t>(G.unwrap());
    const auto hidden_dim = N.unwrap();

    RuntimeCheck(D.unwrap() == 2 * hidden_dim, "invalid dimension");
    RuntimeCheck(hidden_dim % kGroupSize == 0);
    RuntimeCheck(num_experts <= kMaxExperts, "num_experts exceeds maximum (256)");
    RuntimeCheck(num_groups * kGroupSize == hidden_dim, "invalid num_groups");

    const auto params = SiluMulQuantVarlenParams{
        .input = static_cast<const bf16_t*>(input.data_ptr()),
        .output = static_cast<fp8_e4m3_t*>(output.data_ptr()),
        .output_scale = static_cast<float*>(output_scale.data_ptr()),
        .masked_m = static_cast<const int32_t*>(masked_m.data_ptr()),
        .swiglu_limit = static_cast<float>(swiglu_limit),
        .hidden_dim = hidden_dim,
        .num_tokens = num_tokens,
        .num_experts = num_experts,
        .max_rows = num_tokens * topk,
    };

    const auto num_threads = static_cast<uint32_t>(hidden_dim / 8);
    RuntimeCheck(num_threads % device::kWarpThreads == 0);
    RuntimeCheck(num_threads <= kMaxThreads, "hidden_dim / 8 exceeds 1024 threads");
    RuntimeCheck(num_threads >= num_experts);
    const auto num_sm = runtime::get_sm_count(device.unwrap().device_id);
    const auto num_blocks = transposed ? num_sm * blocks_per_sm<kernel_transposed>(num_threads)
                                       : num_sm * blocks_per_sm<kernel_normal>(num_threads);
    const auto kernel = transposed ? kernel_transposed : kernel_normal;
    LaunchKernel(std::min(num_blocks, params.max_rows), num_threads, device.unwrap())  //
        .enable_pdl(kUsePDL)(kernel, params);
  }

 private:
  static constexpr uint32_t kMaxThreads = 1024;

  // Occupancy depends on the kernel and the block size only; a JIT module targets one arch,
  // so one slot per block size serves every device.
  template <auto kernel>
  static uint32_t blocks_per_sm(const uint32_t num_threads) {
    static std::atomic_uint32_t s_cache[kMaxThreads / device::kWarpThreads + 1]{};
    auto& slot = s_cache[num_threads / device::kWarpThreads];
    auto value = slot.load(std::memory_order_relaxed);
    if (value == 0) {
      value = host::runtime::get_blocks_per_sm(kernel, num_threads);
      host::RuntimeCheck(value > 0, "silu_mul_quant_varlen_kernel cannot run with ", num_threads, " threads");
      slot.store(value, std::memory_order_relaxed);
    }
    return value;
  }
};

template <typename DType, bool kUsePDL>
struct SiluAndMulClampKernel {
  static constexpr auto kernel = silu_mul_clamp_kernel<DType, kUsePDL>;

  static void run(const tvm::ffi::TensorView input, const tvm::ffi::TensorView output, const double swiglu_limit) {
    using namespace host;

    auto device = SymbolicDevice{};
    auto M = SymbolicSize{"num_tokens"};
    auto D = SymbolicSize{"gate_up_dim"};  // 2 * out_dim
    auto H = SymbolicSize{"out_dim"};
    device.set_options<kDLCUDA>();

    TensorMatcher({M, D})  // input  (gate || up)
        .with_dtype<DType>()
        .with_device(device)
        .verify(input);
    TensorMatcher({M, H})  // output
        .with_dtype<DType>()
        .with_device(device)
        .verify(output);
    RuntimeCheck(D.unwrap() == 2 * H.unwrap(), "input last dim must be 2 * output last dim");

    constexpr uint32_t kVecSize = 16 / sizeof(DType);
    const auto out_dim = static_cast<uint32_t>(H.unwrap());
    const auto num_tokens = static_cast<uint32_t>(M.unwrap());
    RuntimeCheck(out_dim > 0, "out_dim must be positive");
    RuntimeCheck(out_dim % kVecSize == 0, "out_dim must be divisible by vector size");
    const auto out_vecs = out_dim / kVecSize;
    const auto num_threads = std::min(out_vecs, 1024u);
    const auto blocks_per_row = host::div_ceil(out_vecs, num_threads);

    const auto params = SiluAndMulClampParams{
        .input = input.data_ptr(),
        .output = output.data_ptr(),
        .swiglu_limit = static_cast<float>(swiglu_limit),
        .out_vecs = out_vecs,
        .blocks_per_row = blocks_per_row,
    };
    LaunchKernel(num_tokens * blocks_per_row, num_threads, device.unwrap())  //
        .enable_pdl(kUsePDL)(kernel, params);
  }
};

struct SiluMulQuantContigParams {
  const bf16_t* __restrict__ input;
  fp8_e4m3_t* __restrict__ output;
  float* __restrict__ output_scale;
  float swiglu_limit;  // only read when kApplySwigluLimit=true
  int64_t hidden_dim;
  uint32_t num_tokens;
  uint32_t scale_row_stride_int32;  // only used when kTransposed=true
};

template <uint32_t kGroupSize, bool kScaleUE8M0, bool kTransposed, bool kSwizzle, bool kUsePDL, bool kApplySwigluLimit>
__global__ __launch_bounds__(1024, 2) void  // maximize occupancy
    silu_mul_quant_contig_kernel(const SiluMulQuantContigParams __grid_constant__ params) {
  using namespace device;

  constexpr uint32_t kWorkThreads = kGroupSize / 8u;
  using InputVec = AlignedVector<bf16x2_t, 4>;
  using OutputVec = AlignedVector<fp8x2_e4m3_t, 4>;
  static_assert(kGroupSize == 32 || kGroupSize == 128, "unsupported group_size");
  static_assert(!(kTransposed && !kScaleUE8M0), "transposed layout only supports ue8m0");

  const auto token_id = blockIdx.x;
  const auto work_id = threadIdx.x / kWorkThreads;

  const auto input = params.input + token_id * params.hidden_dim * 2;
  const auto output = params.output + token_id * params.hidden_dim;
  [[maybe_unused]]
  const auto output_scale = [&] {
    const auto num_groups = params.hidden_dim / kGroupSize;
    if constexpr (kTransposed) {
      // Physical layout is (G//4_pad, M_pad) int32; each int32 packs 4
      // consecutive UE8M0 exponents for the same token. Byte address:
      //   (work_id / 4) * M_pad * 4  +  token * 4  +  (work_id % 4).
      const auto base = reinterpret_cast<uint8_t*>(params.output_scale);
      return base + (work_id / 4u) * (params.scale_row_stride_int32 * 4u) + token_id * 4u + (work_id % 4u);
    } else {
      return params.output_scale + token_id * num_groups + work_id;
    }
  }();

  PDLWaitPrimary<kUsePDL>();

  InputVec gate_vec, up_vec;
  if constexpr (kSwizzle) {
    gate_vec.load(input, threadIdx.x * 2);
    up_vec.load(input, threadIdx.x * 2 + 1);
  } else {
    gate_vec.load(input, threadIdx.x);
    up_vec.load(input, threadIdx.x + blockDim.x);
  }

  float local_max = 0.0f;
  float results[8];

#pragma unroll
  for (uint32_t i = 0; i < 4; ++i) {
    const auto [x, y] = silu_and_mul<kApplySwigluLimit>(gate_vec[i], up_vec[i], params.swiglu_limit);
    results[2 * i + 0] = x;
    results[2 * i + 1] = y;
    local_max = fmaxf(local_max, fmaxf(fabsf(x), fabsf(y)));
  }

  local_max = warp::reduce_max<kWorkThreads>(local_max);

  const float absmax = fmaxf(local_max, 1e-10f);
  float scale;
  uint32_t ue8m0_exp;

  if constexpr (kScaleUE8M0) {
    const float raw_scale = absmax / math::FP8_E4M3_MAX;
    ue8m0_exp = cast_to_ue8m0(raw_scale);
    scale = __uint_as_float(ue8m0_exp << 23);
  } else {
    scale = absmax / math::FP8_E4M3_MAX;
  }
  const auto inv_scale = 1.0f / scale;

  OutputVec out_vec;
#pragma unroll
  for (uint32_t i = 0; i < 4; ++i) {
    const float scaled_val0 = results[2 * i + 0] * inv_scale;
    const float scaled_val1 = results[2 * i + 1] * inv_scale;
    out_vec[i] = pack_fp8(scaled_val0, scaled_val1);
  }

  PDLTriggerSecondary<kUsePDL>();

  out_vec.store(output, threadIdx.x);
  if constexpr (kTransposed) {
    *output_scale = ue8m0_exp;
  } else {
    *output_scale = scale;
  }
}

template <int64_t kGroupSize, bool kScaleUE8M0, bool kSwizzle, bool kUsePDL, bool kApplySwigluLimit>
struct SiluAndMulContigPostQuantKernel {
  static_assert(kGroupSize == 32 || kGroupSize == 128);
  static constexpr auto kernel_normal =
      silu_mul_quant_contig_kernel<kGroupSize, kScaleUE8M0, false, kSwizzle, kUsePDL, kApplySwigluLimit>;
  static constexpr auto kernel_transposed =
      silu_mul_quant_contig_kernel<kGroupSize, true, true, kSwizzle, kUsePDL, kApplySwigluLimit>;

  static void
  run(const tvm::ffi::TensorView input,
      const tvm::ffi::TensorView output,
      const tvm::ffi::TensorView output_scale,
      const bool transposed,
      const double swiglu_limit) {
    using namespace host;

    auto device = SymbolicDevice{};
    auto M = SymbolicSize{"num_tokens"};
    auto D = SymbolicSize{"hidden_dim x 2"};
    auto N = SymbolicSize{"hidden_dim"};
    auto G = SymbolicSize{"num_groups"};
    device.set_options<kDLCUDA>();

    TensorMatcher({M, D})  // input (gate/up, natural or gran=8 interleaved on last dim)
        .with_dtype<bf16_t>()
        .with_device(device)
        .verify(input);
    TensorMatcher({M, N})  // fp8 output
        .with_dtype<fp8_e4m3_t>()
        .with_device(device)
        .verify(output);

    const auto hidden_dim = N.unwrap();
    RuntimeCheck(D.unwrap() == 2 * hidden_dim, "invalid dimension");
    RuntimeCheck(hidden_dim % kGroupSize == 0);
    const auto num_groups = static_cast<uint32_t>(hidden_dim / kGroupSize);

    uint32_t scale_row_stride_int32 = 0;
    if (!transposed) {
      G.set_value(num_groups);
      TensorMatcher({M, G})  // (M, G) fp32 natural row-major
          .with_dtype<fp32_t>()
          .with_device(device)
          .verify(output_scale);
    } else {
      RuntimeCheck(kScaleUE8M0, "transposed layout only supports scale_ue8m0=true");
      RuntimeCheck(num_groups % 4 == 0, "transposed layout requires num_groups % 4 == 0");
      auto G_ = SymbolicSize{"G // 4"};
      G_.set_value(num_groups / 4);
      auto M_pad = SymbolicSize{"M padded"};
      TensorMatcher({M, G_})                  // `.transpose(-1,-2)[:M,:]` view of (G//4_pad, M_pad) int32
          .with_strides({int64_t{1}, M_pad})  // col-major transposed
          .with_dtype<int32_t>()
          .with_device(device)
          .verify(output_scale);
      scale_row_stride_int32 = static_cast<uint32_t>(M_pad.unwrap());
    }

    const auto num_tokens = static_cast<uint32_t>(M.unwrap());

    const auto params = SiluMulQuantContigParams{
        .input = static_cast<const bf16_t*>(input.data_ptr()),
        .output = static_cast<fp8_e4m3_t*>(output.data_ptr()),
        .output_scale = static_cast<float*>(output_scale.data_ptr()),
        .swiglu_limit = static_cast<float>(swiglu_limit),
        .hidden_dim = hidden_dim,
        .num_tokens = num_tokens,
        .scale_row_stride_int32 = scale_row_stride_int32,
    };

    const auto num_threads = hidden_dim / 8;
    RuntimeCheck(num_threads % device::kWarpThreads == 0);
    const auto kernel = transposed ? kernel_transposed : kernel_normal;
    LaunchKernel(num_tokens, num_threads, device.unwrap())  //
        .enable_pdl(kUsePDL)(kernel, params);
  }
};

}  // namespace sglang
